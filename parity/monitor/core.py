"""`parity.Monitor`: train/rollout mismatch telemetry inside the user's own training run.

    with parity.Monitor("runs/grpo-7b/parity", thresholds={"k3_kl": 1e-3}) as monitor:
        for step, batch in enumerate(loader):
            ...                                    # rollout, then the trainer's old_log_probs
            monitor.log(step, rollout_log_probs=rollout_lp, old_log_probs=old_lp,
                        response_mask=mask, responses=responses, sampling={"temperature": 1.0})

Per step, `log` checks the arrays (`[batch, response_len]`, responses left-aligned and
right-padded: verl's layout; torch tensors on any device or NumPy arrays), computes the step's
drift record (`parity.monitor.summary`: no forward, the trainer already holds both logprobs),
checks the thresholds (a warning line on the `parity.monitor` logger and a flag in the record), and
appends the record to `out_dir/monitor.sqlite` in one transaction (`parity.monitor.store`). Every
`render_every` steps a background thread has a child process redraw `out_dir/index.html`
(`parity.monitor.page`, `parity.monitor.background`).

Resume: a run restarted from a checkpoint logs steps at or below the stored ones. With
`resume=True` the first such step starts a new attempt of the run (a warning, never an exception):
its steps supersede the stored ones from that step on, the store keeps both, and the page and
`parity monitor` show the run as it stands with the restart marked. Without it such a step is an
`InputError` (two runs must not be merged silently).

Policy versions: `log(..., policy_version=, rollout_policy_version=)` say which weights each side
used. A declared lag (rollout behind the trainer: async, one-step off-policy) is intended drift; a
drift jump with no lag declared, or with both sides claiming the same version, is named as what it
looks like: the rollout engine's weights are not the trainer's (a missed sync).

Cost: the record computes with torch bounded to `threads` (default 1, restored after), the advisor
runs every `advice_every` steps (default 10, and on any step that jumps), and the page is drawn
by a child process: docs/PERF.md ("Monitor in a real run") has the figures.

A counted token one side gives logprob -inf lies outside that side's sampling support (parity's one
rule for -inf, as in reports): it is counted in the summary's `num_tokens_outside_support` /
`frac_tokens_outside_support` and left out of every other number. NaN and +inf at a counted token
are errors (at padding they are ignored), and so is a counted value above 1e-4: probabilities or
logits passed as logprobs (`parity.core.logprobs`, the rule every entry point applies).

Bad input never reaches the store: every check runs, and the whole record is computed, before the
step's transaction; a `log` that raises leaves the store and the monitor as they were, and the next
`log` carries on. Errors are `InputError` (the arrays, the step number, the values) and
`ConfigError` (the monitor's options), each naming the field.

Torch loads on the first `log` (the metrics compute in torch); importing this module, and drawing
or reading a stored run (`parity monitor OUT_DIR`), never loads it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from parity.core.errors import ConfigError, InputError
from parity.core.logprobs import check_logprob_array
from parity.core.outputs import output_dir
from parity.core.schema import SUPPORT_SUMMARY_KEYS
from parity.core.types import SamplingParams
from parity.correction.config import DEFAULT_OPTIONS, CorrectionConfig
from parity.monitor.arrays import host_array
from parity.monitor.background import Background
from parity.monitor.page import PAGE_FILE, PageRenderer, flat_values
from parity.monitor.store import MonitorStore, json_ready, plain
from parity.monitor.thresholds import DEFAULT_JUMPS, WINDOW, Jumps, Thresholds

#: the names `log` gives its arrays in errors (verl's).
ARRAY_NAMES = ("old_log_probs", "rollout_log_probs", "response_mask")
#: prompt ids kept per worst token (the end of its prompt: verl left-pads prompts).
PROMPT_TAIL = 16
#: the largest step the store holds (SQLite's signed 64-bit integer).
MAX_STEP = 2**63 - 1

log = logging.getLogger("parity.monitor")


class Monitor:
    """Logs the train/rollout mismatch of every training step into `out_dir` (see the module doc).

    out_dir: the run's directory (created if missing). An existing one continues its run: steps
        come after the stored ones, or with `resume=True` a step at or below them starts a new
        attempt (a run resumed from an earlier checkpoint).
    run_name: the run's name on the page (default: the directory's name).
    thresholds: absolute alert bounds, e.g. `{"k3_kl": 1e-3, "max_abs_logprob_diff": 1.0}` or a
        `(low, high)` band (`parity.monitor.thresholds`); none by default.
    jumps: relative alert bounds, `{"key": X}` flags a value above X times the run's trailing
        median; default `DEFAULT_JUMPS` (k3_kl 10x, mean_abs_logprob_diff 5x); None: none.
    correction: the `rollout_corr/*` metrics' correction, `parity.correction.CorrectionConfig`
        options (verl's `algorithm.rollout_correction` names); default verl's token-level TIS at 2.
    render_every: redraw the page every this many logged steps (and on `close`), in a background
        thread; 0: never (draw it with `parity monitor OUT_DIR` when wanted).
    advice_every: run the correction advisor every this many logged steps (the first included)
        and on every step that jumps; 0: never. It costs several times the rest of a step, so by
        default it runs in a background thread and its recommendation joins the stored step when
        it is done (`log` returns without it; `close` waits for it).
    advice_in_background: False runs the advisor inside `log` (its record then holds it).
    background: where the page is drawn and the advisor runs: "process" (a spawned worker
        process, off the training process's GIL) or "thread" (threads of this process).
    resume: continue a stored run from any step (see the module doc).
    journal: the store's journal, "auto" (rollback journal on a network filesystem, else WAL),
        "wal" or "delete" (`parity.monitor.store`).
    tokenizer: an object with `decode(ids)` (a Hugging Face tokenizer): the worst tokens get
        their text.
    threads: torch threads for the step's record (set during `log` only, then restored).
    log_scale: draw the page's trend charts on a log scale.
    """

    def __init__(self, out_dir: str | os.PathLike[str], *, run_name: str | None = None,
                 thresholds: Mapping[str, Any] | None = None,
                 jumps: Mapping[str, Any] | None = DEFAULT_JUMPS,
                 correction: Mapping[str, Any] | CorrectionConfig | None = None,
                 render_every: int = 10, advice_every: int = 10, resume: bool = False,
                 journal: str = "auto", tokenizer: Any = None, threads: int = 1,
                 log_scale: bool = False, advice_in_background: bool = True,
                 background: str = "process") -> None:
        if run_name is not None and (not isinstance(run_name, str) or not run_name.strip()):
            raise ConfigError(f"run_name must be a non-empty string or None, got {run_name!r}")
        self.thresholds = Thresholds.of(thresholds)
        self.jumps = Jumps.of(jumps)
        if isinstance(correction, CorrectionConfig):
            self.correction = correction
        else:
            options = DEFAULT_OPTIONS if correction is None else correction
            options = dict(options) if isinstance(options, Mapping) else options
            self.correction = CorrectionConfig.from_dict(options)
        self.render_every = _count(render_every, "render_every", low=0)
        self.advice_every = _count(advice_every, "advice_every", low=0)
        self.threads = _count(threads, "threads", low=1)
        for name, flag in (("resume", resume), ("log_scale", log_scale),
                           ("advice_in_background", advice_in_background)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise ConfigError(f"tokenizer must have decode(ids) (a Hugging Face tokenizer), got "
                              f"{type(tokenizer).__name__}")
        self.resume, self.tokenizer = resume, tokenizer
        self._background = Background(background)
        self.out_dir = output_dir(out_dir, "out_dir")
        self._store = MonitorStore.create(self.out_dir, run_name, journal=journal)
        self.run_name = self._store.run_info()["run_name"]
        self._attempt, self._last_step = self._store.last_attempt()
        self._history = _history(self._store, [k for k, _ in self.jumps.factors])
        self._logged = 0
        self._advice_in_background = advice_in_background
        self._advisor: Any = None  # the AdviceWorker, made on the first step that asks for advice
        self._lock = threading.Lock()
        self._renderer = PageRenderer(self.out_dir, log_scale=log_scale, background=self._background) \
            if self.render_every else None
        if self._renderer is not None:
            self._renderer.request()  # a page exists from the start, "no step logged yet" until one is
        self._closed = False

    @property
    def last_step(self) -> int | None:
        """The last stored step of the latest attempt (earlier sessions included); None before the first."""
        return self._last_step

    @property
    def attempt(self) -> int:
        """The attempt steps are logged into (0 until a resume restarts the run)."""
        return self._attempt

    def log(self, step: int, *, rollout_log_probs: Any, old_log_probs: Any, response_mask: Any,
            responses: Any = None, prompts: Any = None, uids: Sequence[Any] | None = None,
            sampling: Mapping[str, Any] | SamplingParams | None = None,
            meta: Mapping[str, Any] | None = None, policy_version: int | None = None,
            rollout_policy_version: int | None = None, rollout_top_k: Any = None,
            train_top_k: Any = None) -> dict[str, Any]:
        """Check, summarise and store one step; returns the stored record (`{"step": step, ...}`;
        `parity.monitor.flat_values(record)` gives its scalars by name, for your own logger).

        rollout_log_probs, old_log_probs: `[batch, response_len]` logprobs (nats) of the sampled
            tokens from the rollout engine and from the trainer; response_mask: 1/True where a
            token counts. responses: `[batch, response_len]` token ids (the worst tokens then name
            theirs); prompts: `[batch, prompt_len]` ids (left-padded; each worst token keeps the
            last ids of its prompt); uids: one id per row (verl's `uid`), kept with each worst
            token. sampling: what the rollout sampled with (`{"temperature": ...}`,
            `parity.SamplingParams` fields), stored with the step. meta: anything JSON holds.
            policy_version, rollout_policy_version: the trainer's and the rollout's weight versions
            (integers; the rollout's at most the trainer's); their difference is the declared lag.
            rollout_top_k: `(ids, logprobs)` `[batch, response_len, k]`, the rollout engine's top-k
            at every position, with train_top_k the trainer's side (`parity.monitor.train_top_k`):
            adds the `distribution/` keys and the worst positions (`parity.monitor.top_k`).
        """
        # torch: `import parity.monitor` stays light
        from parity.monitor.summary import (
            AdviceWorker,
            bounded_threads,
            check_arrays,
            recommendation,
            step_record,
        )

        with self._lock:
            if self._closed:
                raise ConfigError("this Monitor is closed; make a new one to log more steps")
            step, attempt = self._check_step(step)
            self._store_advice()
            context = {"sampling": _sampling(sampling), "meta": _meta(meta),
                       "policy": _policy(policy_version, rollout_policy_version)}
            old, rollout, mask = (host_array(a, n) for a, n in zip(
                (old_log_probs, rollout_log_probs, response_mask), ARRAY_NAMES))
            old = _clean_padding(old, mask, ARRAY_NAMES[0])
            rollout = _clean_padding(rollout, mask, ARRAY_NAMES[1])
            scored, outside, counted = _support(old, rollout, mask)
            lag = None if context["policy"] is None else context["policy"].get("lag")
            with bounded_threads(self.threads):
                tok = check_arrays(old, rollout, scored, names=ARRAY_NAMES)
                ids = _responses(responses, tok.shape)
                tails = _prompt_tails(prompts, tok.shape[0])
                row_ids = _uids(uids, tok.shape[0])
                record = step_record(tok, correction=self.correction, responses=ids, advice=False)
                if rollout_top_k is not None or train_top_k is not None:
                    from parity.monitor.top_k import step_distribution  # only for steps with top-k rows

                    keys, record["distribution"] = step_distribution(rollout_top_k, train_top_k, rollout, ids,
                                                                     mask, row_ids, self.tokenizer)
                    record["summary"].update(keys)
                record["summary"].update({SUPPORT_SUMMARY_KEYS[0]: outside,
                                          SUPPORT_SUMMARY_KEYS[1]: outside / counted if counted else 0.0})
                values = flat_values(record)
                jumps = self.jumps.check(values, {k: [v for _, v in h] for k, h in self._history.items()})
                advice = bool(jumps) or bool(self.advice_every and self._logged % self.advice_every == 0)
                if advice and not self._advice_in_background:
                    record["recommendation"] = recommendation(tok, policy_lag=lag)
            self._describe_worst(record["worst_tokens"], tails, row_ids)
            record.update({k: v for k, v in context.items() if v is not None})
            record["alerts"] = self.thresholds.check(values) + [
                _with_cause(a, lag, record.get("recommendation")) for a in jumps]
            if self.thresholds.bounds:
                record["thresholds"] = self.thresholds.to_dict()
            if attempt != self._attempt:
                record["restart"] = {"attempt": attempt, "after_step": self._last_step}
            logged_at = self._store.append(step, record, attempt=attempt)
            if advice and self._advice_in_background:
                if self._advisor is None:
                    self._advisor = AdviceWorker(self._background)
                self._advisor.submit(attempt, step, tok, lag)
            if attempt != self._attempt:
                log.warning("parity monitor %s: step %d is at or below the last logged step %s: the run "
                            "was resumed; attempt %d starts here and supersedes the stored steps from %d on",
                            plain(self.run_name), step, self._last_step, attempt, step)
                for h in self._history.values():
                    h[:] = [(s, v) for s, v in h if s < step]
            self._attempt, self._last_step = attempt, step
            for key, h in self._history.items():
                if isinstance(values.get(key), (int, float)):
                    h.append((step, float(values[key])))
                    del h[:-WINDOW]
            self._logged += 1
            for alert in record["alerts"]:
                log.warning("parity monitor %s step %d: %s", plain(self.run_name), step, alert["message"])
            if self._renderer is not None and self._logged % self.render_every == 0:
                self._renderer.request()
            return {"step": step, "logged_at": logged_at, "attempt": attempt, **record}

    def _describe_worst(self, worst: list[dict[str, Any]], tails: list[list[int]] | None,
                        row_ids: list[str] | None) -> None:
        """Each worst token's prompt tail, row uid and decoded text, as given."""
        for w in worst:
            if tails is not None:
                w["prompt_tail"] = tails[w["row"]]
            if row_ids is not None:
                w["uid"] = row_ids[w["row"]]
            if self.tokenizer is not None and w.get("token_id") is not None:
                w["text"] = str(self.tokenizer.decode([w["token_id"]]))

    def _check_step(self, step: Any) -> tuple[int, int]:
        """(the step as an int, the attempt it goes into)."""
        if isinstance(step, bool) or (not isinstance(step, int) and not _is_integer(step)):
            raise InputError(f"step must be an integer, got {step!r}")
        step = int(step)
        if not 0 <= step <= MAX_STEP:
            raise InputError(f"step must be >= 0 and < 2**63 (the store's integer), got {step}")
        if self._last_step is not None and step <= self._last_step:
            if not self.resume:
                raise InputError(f"step {step} does not come after the last logged step {self._last_step}; "
                                 "steps must increase (a run resumed from an earlier checkpoint: "
                                 "Monitor(..., resume=True) starts a new attempt)")
            return step, self._attempt + 1
        return step, self._attempt

    def _store_advice(self, done: list[tuple[int, int, dict[str, Any]]] | None = None) -> None:
        """Store the recommendations the background advisor finished (`done`, or those ready)."""
        if done is None:
            done = self._advisor.drain() if self._advisor is not None else []
        for attempt, step, rec in done:
            self._store.append_advice(attempt, step, rec)

    def close(self) -> None:
        """Wait for the advisor, draw the final page and close the store; closing twice is fine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._advisor is not None:
                    self._store_advice(self._advisor.drain(wait=True))
                if self._renderer is not None:
                    self._renderer.close()
            finally:
                self._background.close()
                self._store.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def page(self) -> Path:
        """The run's page (`out_dir/index.html`)."""
        return self.out_dir / PAGE_FILE


def _history(store: MonitorStore, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    """The trailing values of `keys` of the stored run (as it stands), for the jump bounds."""
    steps = store.steps()[-WINDOW:] if keys else []
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in keys}
    for s in steps:
        for k in keys:
            v = s.get("summary", {}).get(k)
            if isinstance(v, (int, float)):
                out[k].append((s["step"], float(v)))
    return out


def _with_cause(alert: dict[str, Any], lag: int | None, rec: dict[str, Any] | None) -> dict[str, Any]:
    """A jump alert with what the policy versions say about it."""
    if lag is not None and lag > 0:
        cause = f"declared policy lag {lag} (intended off-policy drift)"
    elif lag == 0:
        cause = ("both sides declare the same policy version, yet drift jumped: the rollout engine's "
                 "weights are not the trainer's (a weight-sync bug)")
    else:
        cause = ("no policy versions given: the rollout engine's weights may not be the trainer's (a missed "
                 "weight sync, or policy lag; pass policy_version= and rollout_policy_version= to tell)")
    bugs = (rec or {}).get("data_bugs") or []
    if bugs and lag is None:
        cause = bugs[0]
    return {**alert, "cause": cause, "message": f"{alert['message']}; {cause}"}


def _policy(trainer: Any, rollout: Any) -> dict[str, int] | None:
    """The step's policy versions: `{"trainer", "rollout", "lag"}` (those given)."""
    if trainer is None and rollout is None:
        return None
    out: dict[str, int] = {}
    for name, key, value in (("policy_version", "trainer", trainer),
                             ("rollout_policy_version", "rollout", rollout)):
        if value is None:
            continue
        if isinstance(value, bool) or not (isinstance(value, int) or _is_integer(value)) or int(value) < 0:
            raise InputError(f"{name} must be an integer >= 0 (the weights' version), got {value!r}")
        out[key] = int(value)
    if "trainer" in out and "rollout" in out:
        if out["rollout"] > out["trainer"]:
            raise InputError(f"rollout_policy_version {out['rollout']} is above policy_version "
                             f"{out['trainer']}: the rollout cannot use weights newer than the trainer's; "
                             "swapped?")
        out["lag"] = out["trainer"] - out["rollout"]
    return out


def _uids(value: Sequence[Any] | None, batch: int) -> list[str] | None:
    if value is None:
        return None
    rows = [str(u.item() if hasattr(u, "item") else u) for u in value]
    if len(rows) != batch:
        raise InputError(f"uids has {len(rows)} entries for a batch of {batch}")
    return rows


def _clean_padding(x: np.ndarray, mask: np.ndarray, name: str) -> np.ndarray:
    """`x` with NaN/+inf at padding (mask 0) set to 0 (never read); InputError naming the first
    counted NaN/+inf, and the first counted value above the logprob bound (`parity.core.logprobs`)."""
    if x.dtype.kind != "f" or x.shape != mask.shape or x.size == 0:
        return x
    lo, hi = x.min(), x.max()  # NaN makes both NaN; two reductions, no temporaries
    if not (np.isnan(lo) or hi == np.inf):
        check_logprob_array(x, mask, name)
        return x
    counted = mask.astype(bool)
    bad = np.isnan(x) | np.isposinf(x)
    hit = bad & counted
    if hit.any():
        r, c = np.unravel_index(int(np.argmax(hit)), hit.shape)
        raise InputError(f"{name} contains NaN or +inf: {name}[{r}, {c}] is {x[r, c]} at a counted token "
                         f"({ARRAY_NAMES[2]} 1); log-probabilities must be finite and <= 0 (-inf: outside "
                         "the sampling support; NaN at padding is ignored)")
    x = np.where(bad, np.zeros((), x.dtype), x)
    check_logprob_array(x, counted, name)
    return x


def _count(value: Any, name: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _is_integer(value: Any) -> bool:
    """A NumPy or torch integer scalar (a 0-d tensor's `.item()` is an int)."""
    try:
        return float(value).is_integer() and "int" in str(getattr(value, "dtype", ""))
    except (TypeError, ValueError):
        return False


def _sampling(sampling: Mapping[str, Any] | SamplingParams | None) -> dict[str, Any] | None:
    """The step's sampling as given (no field invented), checked as `SamplingParams` fields."""
    if sampling is None:
        return None
    if isinstance(sampling, SamplingParams):
        return sampling.to_dict()
    if not isinstance(sampling, Mapping):
        raise InputError(f"sampling must be a dict of SamplingParams fields or a SamplingParams, got "
                         f"{type(sampling).__name__}")
    given = {str(k): (v.item() if hasattr(v, "item") else v) for k, v in sampling.items()}
    try:
        SamplingParams.from_dict(dict(given))
    except ConfigError as exc:
        raise InputError(str(exc)) from exc  # a bad value in the data, not in the monitor's options
    return given


def _meta(meta: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        raise InputError(f"meta must be a dict, got {type(meta).__name__}")
    return json_ready(dict(meta))


def _support(old: np.ndarray, rollout: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(the mask of the tokens to measure, tokens outside the sampling support, tokens counted).

    parity's one rule for -inf: a counted token that one side gives logprob -inf lies outside that
    side's sampling support (a top-k/top-p cut). It is counted apart and left out of every other
    number, which it would make infinite. Arrays `check_arrays` will refuse anyway (shapes,
    dtypes) pass through unchanged, so that its error is the one raised."""
    if old.dtype.kind != "f" or rollout.dtype.kind != "f" or not old.shape == rollout.shape == mask.shape:
        return mask, 0, 0
    if not (_has_neginf(old) or _has_neginf(rollout)):
        return mask, 0, 0  # nothing outside: the share is 0 whatever the count
    if mask.dtype != np.bool_ and not np.isin(mask, (0, 1)).all():
        raise InputError(f"{ARRAY_NAMES[2]} must be bool or hold only 0 and 1 (1 = token counts)")
    valid = mask.astype(bool)
    outside = valid & (np.isneginf(old) | np.isneginf(rollout))
    counted, n_outside = int(valid.sum()), int(outside.sum())
    if n_outside and n_outside == counted:
        raise InputError(f"every counted token has logprob -inf in {ARRAY_NAMES[0]} or {ARRAY_NAMES[1]} "
                         "(outside that side's sampling support): there is no token to measure")
    return valid & ~outside, n_outside, counted


def _has_neginf(x: np.ndarray) -> bool:
    """Whether `x` holds -inf: its minimum, ~4x faster than `np.isneginf(x).any()`. A NaN makes
    the minimum NaN and the answer False: `check_arrays` then refuses the NaN."""
    return x.size > 0 and bool(x.min() == -np.inf)


def _responses(value: Any, shape: tuple[int, int]) -> np.ndarray | None:
    """Response token ids `[batch, response_len]` as an int NumPy array, or None."""
    if value is None:
        return None
    ids = host_array(value, "responses")
    if ids.shape != shape:
        raise InputError(f"responses must be [{shape[0]}, {shape[1]}] like the logprobs, got shape "
                         f"{list(ids.shape)}")
    _check_ids(ids, "responses")
    return ids


def _prompt_tails(value: Any, batch: int) -> list[list[int]] | None:
    """The last `PROMPT_TAIL` ids of each row's prompt, from `[batch, prompt_len]` left-padded ids
    or one id sequence per row; None without prompts."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        rows = [host_array(row, f"prompts[{i}]").reshape(-1) for i, row in enumerate(value)]
    else:
        ids = host_array(value, "prompts")
        if ids.ndim != 2:
            raise InputError(f"prompts must be [batch, prompt_len] or one id list per row, got shape "
                             f"{list(ids.shape)}")
        rows = list(ids)
    if len(rows) != batch:
        raise InputError(f"prompts has {len(rows)} rows for a batch of {batch}")
    for i, row in enumerate(rows):
        _check_ids(row, f"prompts[{i}]")
    return [[int(t) for t in row[-PROMPT_TAIL:]] for row in rows]


def _check_ids(ids: np.ndarray, name: str) -> None:
    if ids.size and ids.dtype.kind not in "iu":
        raise InputError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
