"""Assertions on `ParityReport`s, for the pytest plugin and for users' own tests; a failure names
the broken limit and shows the worst tokens.
"""

from __future__ import annotations

from parity.core.errors import ConfigError, InputError
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
    _check_measured(report, "assert_is_ratio_close")
    # a limit whose metric the summary lacks would be skipped: the assertion would hold unchecked
    unmeasured = [key for name, (key, _) in Tolerance.CHECKS.items()
                  if getattr(applied, name) is not None and key not in report.summary]
    if unmeasured:
        raise InputError(f"assert_is_ratio_close: the report's summary has no {unmeasured[0]!r} to check "
                         f"against its limit; pass {_field(unmeasured[0])}=None to skip that check")
    violations = applied.violations(report.summary)
    if violations:
        raise AssertionError(failure_message(report, violations))


def assert_parity(report: ParityReport) -> None:
    """Assert `report.passed`, with the report's own violations in the message."""
    if not isinstance(report, ParityReport):
        raise ConfigError(f"assert_parity needs a ParityReport, got {type(report).__name__}")
    _check_measured(report, "assert_parity")
    if not report.passed:
        raise AssertionError(failure_message(report, report.violations))


def _check_measured(report: ParityReport, name: str) -> None:
    """InputError for a report of no tokens: its verdict measured nothing, so it asserts nothing."""
    if report.num_tokens == 0:
        raise InputError(f"{name}: the report holds no tokens (mask is all false), so no drift was measured; "
                         "compare at least one generated token")


def _field(metric: str) -> str:
    """The `Tolerance` field that limits summary key `metric`."""
    return next(name for name, (key, _) in Tolerance.CHECKS.items() if key == metric)
