"""`ParityReport`: everything one comparison measured, serializable to JSON and HTML.

Per-token arrays are `[num_sequences, max_response_len]`, `mask` marking real tokens (padding is
zeros). `ParityReport.from_json(r.to_json()) == r` bit for bit, NaN included.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity.core.errors import InputError
from parity.core.schema import text_apart
from parity.drift.tolerance import Tolerance, Violation

FORMAT = "parity-report"
FORMAT_VERSION = 1

#: response tokens shown on each side of a worst token (when the report holds decoded text).
CONTEXT_TOKENS = 4

#: the optional per-token array of the gold forward's logprobs (`parity.engine.gold`), and its dtype.
GOLD_FIELD, GOLD_DTYPE = "gold_logprobs", np.float64

#: per-token array fields and the dtype each is stored in.
ARRAY_FIELDS: dict[str, type] = {
    "train_logprobs": np.float32,
    "rollout_logprobs": np.float32,
    "mask": np.bool_,
    "positions": np.int64,
    "token_ids": np.int64,
}


@dataclass(eq=False)
class ParityReport:
    """The result of one parity comparison.

    train_logprobs / rollout_logprobs: float32 `[num_sequences, max_response_len]`, nats. mask:
    bool. positions: int64, prompt_len + response index. token_ids: int64. sequences: a dict per row.
    summary: scalar drift metrics; metrics: verl's `rollout_corr/*`. breakdowns: drift per bucket.
    passed / tolerance / violations: the verdict. provenance: what produced the numbers.
    extras: free-form sections ("attribution", "router", "gold"). gold_logprobs: float64 or None.
    """

    train_logprobs: np.ndarray
    rollout_logprobs: np.ndarray
    mask: np.ndarray
    positions: np.ndarray
    token_ids: np.ndarray
    sequences: list[dict[str, Any]]
    summary: dict[str, Any]
    metrics: dict[str, Any]
    breakdowns: dict[str, Any]
    passed: bool
    tolerance: Tolerance
    violations: list[Violation]
    provenance: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    gold_logprobs: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name, dtype in ARRAY_FIELDS.items():
            arr = np.asarray(getattr(self, name))
            if arr.ndim != 2:
                raise InputError(f"ParityReport.{name} must be 2-D [num_sequences, max_response_len], "
                                 f"got shape {arr.shape}")
            setattr(self, name, arr.astype(dtype, copy=False))
        shape = self.train_logprobs.shape
        for name in ARRAY_FIELDS:
            if getattr(self, name).shape != shape:
                raise InputError(f"ParityReport.{name} has shape {getattr(self, name).shape}, expected "
                                 f"{shape} like train_logprobs")
        if self.gold_logprobs is not None:
            self.gold_logprobs = np.asarray(self.gold_logprobs).astype(GOLD_DTYPE, copy=False)
            if self.gold_logprobs.shape != shape:
                raise InputError(f"ParityReport.gold_logprobs has shape {self.gold_logprobs.shape}, expected "
                                 f"{shape} like train_logprobs")
        if len(self.sequences) != shape[0]:
            raise InputError(f"ParityReport.sequences has {len(self.sequences)} entries for {shape[0]} rows; "
                             "give one dict per row")
        self.violations = [Violation(*v) for v in self.violations]
        self.passed = bool(self.passed)
        if self.passed == bool(self.violations):  # a page would show PASS beside a violation, or FAIL alone
            raise InputError(f"ParityReport.passed is {self.passed} with {len(self.violations)} "
                             "violation(s): the verdict must be passed=not violations")

    # -- serialization -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (arrays as nested lists with their dtype and shape)."""
        out: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION}
        for f in dataclasses.fields(self):
            if f.name in ARRAY_FIELDS or f.name == GOLD_FIELD:
                continue
            value = getattr(self, f.name)
            if f.name == "tolerance":
                value = value.to_dict()
            elif f.name == "violations":
                value = [v._asdict() for v in value]
            out[f.name] = _plain(value)
        # float32 -> Python float is exact, and json writes the shortest repr that reads back
        # to the same double, so the arrays survive the round trip bit for bit
        stored = {**ARRAY_FIELDS, **({GOLD_FIELD: GOLD_DTYPE} if self.gold_logprobs is not None else {})}
        out["arrays"] = {
            name: {"dtype": np.dtype(dtype).name, "shape": list(getattr(self, name).shape),
                   "data": getattr(self, name).tolist()}
            for name, dtype in stored.items()
        }
        return out

    def to_json(self, *, indent: int | None = None) -> str:
        """JSON text. Non-finite floats are written as NaN / Infinity / -Infinity (as Python's
        json module does), because a train logprob of -inf is a real finding, not an error."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParityReport:
        if d.get("format") != FORMAT:
            raise InputError(f"not a parity report: format is {d.get('format')!r}, expected {FORMAT!r}")
        # type check: JSON's true equals 1 in Python, and is no version number
        if type(d.get("version")) is not int or d.get("version") != FORMAT_VERSION:
            raise InputError(f"parity report version {d.get('version')!r} is not supported "
                             f"(this parity reads version {FORMAT_VERSION})")
        try:
            arrays = {}
            optional = {GOLD_FIELD: GOLD_DTYPE} if GOLD_FIELD in d["arrays"] else {}
            for name, dtype in {**ARRAY_FIELDS, **optional}.items():
                arrays[name] = _stored_array(name, d["arrays"][name], dtype)
            tolerance = _stored_tolerance(d["tolerance"])
            violations = [Violation(v["metric"], v["value"], v["limit"]) for v in d["violations"]]
            _check_stored_violations(tolerance, d["summary"], violations)
            return cls(
                **arrays,
                sequences=d["sequences"], summary=d["summary"], metrics=d["metrics"],
                breakdowns=d["breakdowns"], passed=_stored_verdict(d["passed"], d["violations"]),
                tolerance=tolerance, violations=violations,
                provenance=d["provenance"], extras=d.get("extras", {}),
            )
        except KeyError as exc:
            raise InputError(f"parity report is missing field {exc.args[0]!r}; was it written by "
                             "ParityReport.to_json?") from exc

    @classmethod
    def from_json(cls, s: str) -> ParityReport:
        try:
            d = json.loads(s)
        except json.JSONDecodeError as exc:
            raise InputError(f"parity report is not valid JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise InputError("parity report JSON must be an object")
        return cls.from_dict(d)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParityReport):
            return NotImplemented
        # canonical JSON: key order is presentation (to_json keeps it), not content
        return json.dumps(self.to_dict(), sort_keys=True) == json.dumps(other.to_dict(), sort_keys=True)

    __hash__ = None  # mutable: extras may be attached after construction

    def __repr__(self) -> str:
        prov = self.provenance
        return (f"ParityReport(backend={prov.get('backend')!r}, model={prov.get('model')!r}, "
                f"passed={self.passed}, sequences={self.mask.shape[0]}, tokens={int(self.mask.sum())}, "
                f"max_abs_logprob_diff={self.summary.get('max_abs_logprob_diff')!r})")

    # -- views -------------------------------------------------------------------------------

    def log_ratio(self) -> np.ndarray:
        """float64 `[num_tokens]`: logp_train - logp_rollout of every real token, row-major."""
        return self.train_logprobs[self.mask].astype(np.float64) - self.rollout_logprobs[self.mask]

    def gold_errors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(|train - gold|, |rollout - gold| (nats, float64), response position (int64)) `[tokens]` of
        every real token all three sides give a finite logprob, row-major; None without a gold."""
        if self.gold_logprobs is None:
            return None
        with np.errstate(invalid="ignore"):
            keep = (self.mask & np.isfinite(self.train_logprobs) & np.isfinite(self.rollout_logprobs)
                    & np.isfinite(self.gold_logprobs))
        gold = self.gold_logprobs[keep]
        return (np.abs(self.train_logprobs[keep] - gold), np.abs(self.rollout_logprobs[keep] - gold),
                np.nonzero(keep)[1].astype(np.int64))

    @property
    def num_tokens(self) -> int:
        """Real response tokens in the report (True entries of `mask`)."""
        return int(self.mask.sum())

    def worst_tokens(self, k: int = 5) -> list[dict[str, Any]]:
        """The k tokens with the largest |logp_train - logp_rollout|, largest first (equal ones never;
        ties row-major), with both logprobs, their diff and ratio, the gold's, and the token's text and
        context when the report holds text.
        """
        if k < 0:
            raise InputError(f"worst_tokens: k must be >= 0, got {k}")
        rows, cols = np.nonzero(self.mask)
        train = self.train_logprobs[rows, cols].astype(np.float64)
        rollout = self.rollout_logprobs[rows, cols].astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = train - rollout
            # NaN sorts first: an undefined difference is the worst finding there is
            key = np.where(np.isnan(diff), np.inf, np.abs(diff))
        order = np.argsort(-key, kind="stable")
        # equal sides are no finding: -inf on both (outside both supports) gives a NaN diff
        order = order[(train != rollout)[order]][:k]
        text = self.extras.get("text")
        out = []
        for i in order:
            r, c = int(rows[i]), int(cols[i])
            with np.errstate(over="ignore"):
                ratio = float(np.exp(diff[i]))
            row = {
                "sequence": r, "request_id": self.sequences[r].get("request_id"), "position": c,
                "token_id": int(self.token_ids[r, c]), "train_logprob": float(train[i]),
                "rollout_logprob": float(rollout[i]), "logprob_diff": float(diff[i]), "ratio": ratio,
            }
            if self.gold_logprobs is not None:
                row["gold_logprob"] = float(self.gold_logprobs[r, c])
            if text:
                row.update(self._in_context(r, c, text))
            out.append(row)
        return out

    def _in_context(self, row: int, col: int, text: dict[str, Any]) -> dict[str, str]:
        """The decoded token at (row, col), its neighbours and the start of its prompt."""
        tokens = text.get("tokens", {})
        length = int(self.mask[row].sum())

        def span(start: int, stop: int) -> str:
            return "".join(tokens.get(str(int(t)), "") for t in self.token_ids[row, max(start, 0):stop])

        return {"text": span(col, col + 1), "before": span(col - CONTEXT_TOKENS, col),
                "after": span(col + 1, min(col + 1 + CONTEXT_TOKENS, length)),
                "prompt": text.get("prompts", {}).get(str(self.sequences[row].get("request_id")), "")}

    def request_drift(self) -> list[dict[str, Any]]:
        """Drift per request id, first-seen order: samples, tokens, outside_support, max and mean |Δ| (nats;
        NaN where no token is inside both sides' support), identical, and prompt when the report holds text.
        """
        prompts = self.extras.get("text", {}).get("prompts", {})
        groups: dict[str, list[int]] = {}
        for i, seq in enumerate(self.sequences):
            groups.setdefault(str(seq.get("request_id")), []).append(i)
        out = []
        for request_id, rows in groups.items():
            mask = self.mask[rows]
            train = self.train_logprobs[rows][mask].astype(np.float64)
            rollout = self.rollout_logprobs[rows][mask].astype(np.float64)
            outside = np.isneginf(train) | np.isneginf(rollout)
            with np.errstate(invalid="ignore"):
                diff = np.abs(train[~outside] - rollout[~outside])
            out.append({
                "request_id": request_id, "samples": len(rows), "tokens": int(diff.size),
                "outside_support": int(outside.sum()),
                # NaN, not 0: no token inside both sides' support, so no drift was measured
                "max_abs_logprob_diff": float(diff.max()) if diff.size else float("nan"),
                "mean_abs_logprob_diff": float(diff.mean()) if diff.size else float("nan"),
                "identical": bool(np.array_equal(train, rollout)), "prompt": prompts.get(request_id, ""),
            })
        return out

    def summary_text(self) -> str:
        """The verdict and the summary as an aligned plain-text table (CLI output)."""
        return format_summary(self)


def format_worst_tokens(rows: list[dict[str, Any]], num_tokens: int | None = None) -> str:
    """Plain-text table of `ParityReport.worst_tokens()` rows (failure messages, CLI); with
    decoded text, a last column shows the token in brackets within its context (escaped, so a
    newline reads \\n). No rows: "all `num_tokens` tokens identical"."""
    if not rows:
        return "no tokens" if not num_tokens else f"all {num_tokens} tokens identical"
    with_gold = "gold_logprob" in rows[0]
    header = ("sequence", "position", "token_id", "train_logprob", "rollout_logprob",
              *(("gold_logprob",) if with_gold else ()), "ratio")
    with_text = "text" in rows[0]
    lines = [[str(h) for h in header] + (["token in context"] if with_text else [])]
    for row in rows:
        lines.append([str(row["sequence"]), str(row["position"]), str(row["token_id"]),
                      *logprob_pair(row["train_logprob"], row["rollout_logprob"]),
                      *((f"{row['gold_logprob']:.6f}",) if with_gold else ()), ratio_text(row["ratio"])])
        if with_text:
            lines[-1].append(f"{_escaped(row['before'])}[{_escaped(row['text'])}]{_escaped(row['after'])}")
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join([*(cell.rjust(w) for cell, w in zip(line, widths)), *line[len(header):]])
                     for line in lines)


def logprob_pair(train: float, rollout: float) -> tuple[str, str]:
    """Two logprobs at 6 decimals, or at 9 significant digits (float32's round-trip precision) where
    6 decimals would print two different values alike (a worst token must not read as identical)."""
    a, b = f"{train:.6f}", f"{rollout:.6f}"
    return (f"{train:.9g}", f"{rollout:.9g}") if a == b and train != rollout else (a, b)


def ratio_text(ratio: float) -> str:
    """An importance ratio at 6 decimals, or as `number_text` where 6 decimals would print a ratio that
    is not 0 or 1 as 0 (a token the trainer gives 1e-13 of the rollout's probability is no -inf) or 1."""
    text = f"{ratio:.6f}"
    return number_text(ratio) if float(text) in (0.0, 1.0) and float(text) != ratio else text


def number_text(value: float, digits: int = 6) -> str:
    """`value` to `digits` significant digits, more where that would print a value that is not ±1
    as 1 (an agreement of 0.9999997 or an IS ratio of 1.0000003 must not read as exact)."""
    return text_apart(value, digits, (1.0, -1.0))


def _escaped(text: str) -> str:
    """`text` on one terminal line: each unprintable character (newline, tab, ...) as its escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def format_summary(report: ParityReport) -> str:
    """Verdict line, the summary metrics and the violations, as aligned text."""
    prov = report.provenance
    verdict = "PASS" if report.passed else "FAIL"
    lines = [f"parity {verdict}: backend={prov.get('backend', '?')} model={prov.get('model', '?')} "
             f"dtype={prov.get('dtype', '?')} reference={prov.get('reference_kernels', '?')}"]
    for side in ("train_logprobs", "rollout_logprobs"):
        if side in prov:  # where each side's numbers came from (score: a dump's trainer logprobs)
            lines.append(f"  {side.replace('_', ' ')}: {prov[side]}")
    width = max((len(k) for k in report.summary), default=0)
    for key, value in report.summary.items():
        text = number_text(value) if isinstance(value, float) else str(value)
        lines.append(f"  {key.ljust(width)}  {text}")
    for v in report.violations:
        lines.append(f"  violation: {v.describe()}")
    if "by_turn" in report.breakdowns:  # a multi-turn report: generated tokens by turn
        rows = [(f"turn {r['lo']}", r) for r in report.breakdowns["by_turn"]]
        rows += [(f"{r['lo']} after injection" if r["lo"] == "first" else "rest", r)
                 for r in report.breakdowns["after_injection"]]
        lines.append("  drift by turn (max / mean |Δlogp| over generated tokens):")
        for label, r in rows:
            drift = "no tokens" if not r["num_tokens"] else \
                f"{r['max_abs_logprob_diff']:.3e} / {r['mean_abs_logprob_diff']:.3e}"
            lines.append(f"    {label.ljust(22)} {str(r['num_tokens']).rjust(6)} tokens  {drift}")
    return "\n".join(lines)


def _stored_array(name: str, spec: dict[str, Any], dtype: type) -> np.ndarray:
    """One array of a stored report as `dtype` in its stored shape; InputError unless every value
    reads as `dtype` unchanged (a float64 logprob rounded to float32, a position of 7.5 cut to 7 or a
    mask of 2 made True would alter the numbers the report shows)."""
    where = f"parity report array {name!r}"
    try:
        raw = np.asarray(spec["data"])
        # reshape keeps the shape of empty arrays ([0, 0] lists carry no column count)
        with np.errstate(over="ignore", invalid="ignore"):  # a value that overflows is refused below
            arr = raw.astype(dtype).reshape(spec["shape"])
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where} does not read as {np.dtype(dtype).name} of shape {spec.get('shape')}: "
                         f"{exc}") from exc
    if raw.size and raw.shape != arr.shape:  # nested lists of another shape: refused, not reflowed
        raise InputError(f"{where} holds lists of shape {list(raw.shape)} but says shape {spec['shape']}; "
                         "write the report with ParityReport.to_json")
    if raw.dtype.kind not in "biuf" or not np.array_equal(arr.ravel(), raw.ravel(),
                                                          equal_nan=raw.dtype.kind == "f"):
        raise InputError(f"{where} holds values that {np.dtype(dtype).name} cannot store exactly "
                         f"(stored dtype {spec.get('dtype')!r}); write the report with ParityReport.to_json")
    return arr


def _stored_tolerance(stored: Any) -> Tolerance:
    """A stored report's tolerance: every limit stored (null where a check was off); a missing one
    would read back as today's bf16 default, a limit the report was never judged by."""
    if isinstance(stored, dict):
        missing = [f.name for f in dataclasses.fields(Tolerance) if f.name not in stored]
        if missing:
            raise InputError(f"parity report tolerance is missing limit {missing[0]!r} (null if the check "
                             "was off); write the report with ParityReport.to_json")
    return Tolerance.from_dict(stored, where="report.tolerance")


def _check_stored_violations(tolerance: Tolerance, summary: Any, stored: list[Violation]) -> None:
    """InputError unless a stored report's violations are those its stored tolerance finds in its stored
    summary (`Tolerance.violations`, unchanged since the format began), on each checked metric the summary
    holds: one edited, or a verdict written under other limits, would show a PASS or FAIL its own
    numbers contradict."""
    if not isinstance(summary, dict):
        raise InputError(f"parity report field 'summary' must be an object, got {type(summary).__name__}")
    try:
        expected = tolerance.violations(summary)
    except (TypeError, ValueError) as exc:
        raise InputError(f"parity report summary holds a checked metric that is not a number: {exc}") from exc

    def canonical(violations: list[Violation]) -> list[str]:  # NaN equals NaN; order is not content
        return sorted(json.dumps([v.metric, float(v.value), float(v.limit)]) for v in violations)

    held = {key for key, _ in Tolerance.CHECKS.values() if key in summary}
    try:
        same = canonical([v for v in stored if v.metric in held]) == canonical(expected)
    except (TypeError, ValueError):
        same = False
    if not same:
        found = "; ".join(v.describe() for v in expected) or "none"
        raise InputError(f"parity report field 'violations' holds {len(stored)}, but its tolerance finds "
                         f"{len(expected)} in its summary ({found}): the stored verdict contradicts its own "
                         "numbers (edited?); write the report with ParityReport.to_json (run compare or "
                         "score again)")


def _stored_verdict(passed: Any, violations: list[Any]) -> bool:
    """A stored report's `passed`: JSON true or false, agreeing with its violations."""
    if not isinstance(passed, bool):
        raise InputError(f"parity report field 'passed' is {passed!r}; it must be true or false")
    if passed == bool(violations):
        raise InputError(f"parity report field 'passed' is {str(passed).lower()} with {len(violations)} "
                         "violation(s): the verdict contradicts its violations")
    return passed


def _plain(value: Any) -> Any:
    """Recursively turn NumPy scalars/arrays and tuples into JSON-native values."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value
