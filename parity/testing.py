"""Assertions on `ParityReport`s, for the pytest plugin and for users' own tests; a failure names
the broken limit and shows the worst tokens.
"""

from __future__ import annotations

from parity.core.errors import ConfigError
from parity.drift.tolerance import Tolerance, Violation
from parity.report.document import ParityReport, format_worst_tokens

#: worst tokens shown in a failure message.
WORST_TOKENS = 5


def failure_message(report: ParityReport, violations: list[Violation], *, k: int = WORST_TOKENS) -> str:
    """What failed (metric, value vs limit), in which setting, and the `k` worst tokens."""
    prov = report.provenance
    lines = [
        f"parity check failed: backend {prov.get('backend', '?')!r} vs the training forward on "
        f"{prov.get('model', '?')} (dtype {prov.get('dtype', '?')}, reference kernels "
        f"{prov.get('reference_kernels', '?')}, {report.summary.get('num_tokens', '?')} tokens)",
    ]
    lines += [f"  {v.describe()}" for v in violations]
    lines.append(f"{k} worst tokens by |logp_train - logp_rollout| (ratio = exp(train - rollout)):")
    table = format_worst_tokens(report.worst_tokens(k), report.num_tokens)
    lines += ["  " + line for line in table.splitlines()]
    return "\n".join(lines)


def assert_is_ratio_close(report: ParityReport, tolerance: Tolerance | None = None,
                          **limits: float | None) -> None:
    """Assert the importance ratio is close to 1 in `report` under `tolerance` (None: the report's) with
    `limits` overriding fields (None skips one); AssertionError with `failure_message` otherwise.
    """
    if not isinstance(report, ParityReport):
        raise ConfigError(f"assert_is_ratio_close needs a ParityReport, got {type(report).__name__}")
    base = tolerance if tolerance is not None else report.tolerance
    applied = Tolerance.from_dict({**base.to_dict(), **limits}, where="assert_is_ratio_close") if limits \
        else base
    violations = applied.violations(report.summary)
    if violations:
        raise AssertionError(failure_message(report, violations))


def assert_parity(report: ParityReport) -> None:
    """Assert `report.passed`, with the report's own violations in the message."""
    if not report.passed:
        raise AssertionError(failure_message(report, report.violations))
