"""`parity.Monitor`: train/rollout mismatch telemetry inside the user's own training run.

Per step `log` checks the `[batch, response_len]` arrays (verl's layout), computes the drift
record (`parity.monitor.summary`, no forward), checks thresholds (a warning and a flag) and
appends it in one transaction; every `render_every` steps a child process redraws the page.
A step at or below stored ones is an `InputError`, or with `resume=True` a new attempt. Declared
policy versions make lag intended; a jump without one is named a missed weight sync. -inf at a
counted token is outside that side's support (counted apart); NaN, +inf or values above 1e-4 are
errors. A `log` that raises leaves store and monitor unchanged. Costs: docs/PERF.md.
"""

from __future__ import annotations

import dataclasses
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
from parity.core.types import SamplingParams, check_int, scalar_meant, top_k_off
from parity.correction.config import DEFAULT_OPTIONS, CorrectionConfig
from parity.monitor.arrays import host_array, negative_id
from parity.monitor.background import Background
from parity.monitor.page import PAGE_FILE, PageRenderer, flat_values
from parity.monitor.store import MonitorStore, json_ready, plain
from parity.monitor.thresholds import (
    DEFAULT_JUMPS,
    WINDOW,
    Jumps,
    Thresholds,
    alike,
    sampling_key,
    stored_sampling_key,
)

#: the names `log` gives its arrays in errors (verl's).
ARRAY_NAMES = ("old_log_probs", "rollout_log_probs", "response_mask")
#: prompt ids kept per worst token (the end of its prompt: verl left-pads prompts).
PROMPT_TAIL = 16
#: the largest step the store holds (SQLite's signed 64-bit integer).
MAX_STEP = 2**63 - 1

log = logging.getLogger("parity.monitor")


class Monitor:
    """Logs the train/rollout mismatch of every training step into `out_dir` (see the module doc).

    out_dir: created if missing; an existing one continues its run. thresholds: absolute bounds or
    `(low, high)` bands (`parity.monitor.thresholds`); jumps: x trailing median (`DEFAULT_JUMPS`;
    None: off). correction: `CorrectionConfig` options (default token TIS at 2). render_every,
    advice_every: 0 is never (advice also on jumps; in the background unless
    `advice_in_background=False`). background: "process" or "thread". journal: "auto", "wal",
    "delete". tokenizer: `decode(ids)` for worst tokens' text. threads: torch threads during `log`.
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
        self.render_every = check_int(render_every, "render_every", low=0)
        self.advice_every = check_int(advice_every, "advice_every", low=0)
        self.threads = check_int(threads, "threads", low=1)
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
        try:
            _check_same_correction(self._store, self.correction, plain(self.run_name))
        except BaseException:
            self._store.close()
            raise
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
        """Check, summarise and store one step; returns the stored record (`flat_values` gives its scalars).

        rollout_log_probs, old_log_probs: `[batch, response_len]` nats; response_mask: 1 where a token
        counts. responses `[batch, response_len]`, prompts `[batch, prompt_len]` (left-padded), uids:
        name the worst tokens. sampling: `SamplingParams` fields (a jump is judged against the trailing
        steps of the same temperature, top_k and top_p; unknown matches any). meta: JSON. policy_version,
        rollout_policy_version: ints, their difference the declared lag. rollout_top_k `(ids, logprobs)`
        `[batch, response_len, k]` with train_top_k: the `distribution/` keys.
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
            context = {"sampling": checked_sampling(sampling), "meta": _meta(meta),
                       "policy": _policy(policy_version, rollout_policy_version)}
            old, rollout, mask = (host_array(a, n) for a, n in zip(
                (old_log_probs, rollout_log_probs, response_mask), ARRAY_NAMES))
            old = _clean_padding(old, mask, ARRAY_NAMES[0])
            rollout = _clean_padding(rollout, mask, ARRAY_NAMES[1])
            scored, outside, counted = _support(old, rollout, mask)
            lag = None if context["policy"] is None else context["policy"].get("lag")
            with bounded_threads(self.threads):
                tok = check_arrays(old, rollout, scored, names=ARRAY_NAMES)
                ids = _responses(responses, tok.shape, mask)
                tails = _prompt_tails(prompts, tok.shape[0])
                row_ids = _uids(uids, tok.shape[0])
                record = step_record(tok, correction=self.correction, responses=ids, advice=False)
                if rollout_top_k is not None or train_top_k is not None:
                    from parity.monitor.top_k import step_distribution  # only for steps with top-k rows

                    keys, record["distribution"] = step_distribution(rollout_top_k, train_top_k, rollout, ids,
                                                                     mask, row_ids, self.tokenizer,
                                                                     train_log_probs=old)
                    record["summary"].update(keys)
                record["summary"].update({SUPPORT_SUMMARY_KEYS[0]: outside,
                                          SUPPORT_SUMMARY_KEYS[1]: outside / counted if counted else 0.0})
                values = flat_values(record)
                # a new attempt is judged against the steps it keeps, never against those it supersedes
                history = self._history if attempt == self._attempt else \
                    _history(self._store, list(self._history), before=step)
                # judged against the trailing steps sampled alike: processed logprobs' drift scales
                # with 1/temperature, so another sampling's median is no baseline for a jump
                regime = sampling_key(context["sampling"])
                jumps = self.jumps.check(values, {k: [v for _, v, r in h if alike(r, regime)]
                                                  for k, h in history.items()})
                advice = bool(jumps) or bool(self.advice_every and self._logged % self.advice_every == 0)
                if advice and not self._advice_in_background:
                    record["recommendation"] = recommendation(tok, policy_lag=lag)
            self._describe_worst(record["worst_tokens"], tails, row_ids)
            record.update({k: v for k, v in context.items() if v is not None})
            record["correction"] = correction_options(self.correction)
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
                self._history = history
            self._attempt, self._last_step = attempt, step
            for key, h in self._history.items():
                if isinstance(values.get(key), (int, float)):
                    h.append((step, float(values[key]), regime))
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


def _history(store: MonitorStore, keys: list[str], *, before: int | None = None
             ) -> dict[str, list[tuple[int, float, tuple[float, int, float] | None]]]:
    """The trailing (step, value, sampling key) of `keys` of the stored run (as it stands; only its
    steps below `before`, those a new attempt starting there keeps), for the jump bounds."""
    steps = [s for s in store.steps() if before is None or s["step"] < before][-WINDOW:] if keys else []
    out: dict[str, list[tuple[int, float, tuple[float, int, float] | None]]] = {k: [] for k in keys}
    for s in steps:
        regime = stored_sampling_key(s.get("sampling"))
        for k in keys:
            v = s.get("summary", {}).get(k)
            if isinstance(v, (int, float)):
                out[k].append((s["step"], float(v), regime))
    return out


def correction_options(config: CorrectionConfig) -> dict[str, Any]:
    """The options of `config` as `CorrectionConfig.from_dict` takes them: what a step's
    `rollout_corr/*` metrics were computed with, stored with them."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def _check_same_correction(store: MonitorStore, correction: CorrectionConfig, run_name: str) -> None:
    """ConfigError when the run's stored steps carry `rollout_corr/*` metrics of another correction:
    continuing would chart two corrections' metrics as one series (steps stored before the
    correction was recorded with them are taken as they are)."""
    last = store.latest_record()
    stored = None if last is None else last.get("correction")
    if stored is None:
        return
    try:
        before = CorrectionConfig.from_dict(dict(stored)) if isinstance(stored, Mapping) else None
    except ConfigError:
        before = None
    if before is not None and (before.is_rule, before.rs_rules) == (correction.is_rule, correction.rs_rules):
        return
    raise ConfigError(f"correction {correction_options(correction)}: {store.path} holds run {run_name!r}, "
                      f"whose stored steps' rollout_corr/* metrics were computed with correction {stored}; "
                      "a run charts one correction's metrics (give its correction=, or another out_dir)")


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
    """`x` with NaN/+inf at padding set to 0; InputError naming the first counted NaN/+inf or value
    above the logprob bound.
    """
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


def _is_integer(value: Any) -> bool:
    """A NumPy or torch integer scalar (a 0-d tensor's `.item()` is an int)."""
    try:
        return float(value).is_integer() and "int" in str(getattr(value, "dtype", ""))
    except (TypeError, ValueError):
        return False


def checked_sampling(sampling: Mapping[str, Any] | SamplingParams | None) -> dict[str, Any] | None:
    """The step's sampling as given (no field invented, NumPy/torch scalars as Python's: `scalar_meant`;
    top_k -1 as 0), checked as `SamplingParams` fields: InputError for a field or value it does not know."""
    if sampling is None:
        return None
    if isinstance(sampling, SamplingParams):
        return sampling.to_dict()
    if not isinstance(sampling, Mapping):
        raise InputError(f"sampling must be a dict of SamplingParams fields or a SamplingParams, got "
                         f"{type(sampling).__name__}")
    given = {str(k): _scalar(v, f"sampling[{str(k)!r}]") for k, v in sampling.items()}
    if "top_k" in given:  # -1, the trainers' "off", as 0: the rule of dumps and batches (`top_k_off`)
        given["top_k"] = top_k_off(given["top_k"])
    try:
        SamplingParams.from_dict(dict(given))
    except ConfigError as exc:
        raise InputError(str(exc)) from exc  # a bad value in the data, not in the monitor's options
    return given


def _scalar(value: Any, name: str) -> Any:
    """A NumPy or torch scalar (a 0-d or one-element array) as Python's; InputError for more values."""
    try:
        return scalar_meant(value)  # a bfloat16 0.7 as 0.7, not 0.69921875
    except (ValueError, RuntimeError) as exc:  # several values: NumPy's ValueError, torch's RuntimeError
        raise InputError(f"{name} must be one value for the step, got {type(value).__name__} of shape "
                         f"{list(getattr(value, 'shape', []))}; log each sampling's rows as their own "
                         "step") from exc


def _meta(meta: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        raise InputError(f"meta must be a dict, got {type(meta).__name__}")
    return json_ready(dict(meta), keep_nonfinite=True)  # stored marked: inf reads back as inf


def _support(old: np.ndarray, rollout: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(mask of tokens to measure, tokens outside the support, tokens counted): -inf tokens are counted
    apart; arrays `check_arrays` will refuse pass through so its error is the one raised.
    """
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
    """Whether `x` holds -inf via its minimum (~4x `np.isneginf(x).any()`; NaN is refused later)."""
    return x.size > 0 and bool(x.min() == -np.inf)


def _responses(value: Any, shape: tuple[int, int], mask: np.ndarray) -> np.ndarray | None:
    """Response token ids `[batch, response_len]` as an int NumPy array, or None; no negative id where
    `mask` is set (padding may hold any id)."""
    if value is None:
        return None
    ids = host_array(value, "responses")
    if ids.shape != shape:
        raise InputError(f"responses must be [{shape[0]}, {shape[1]}] like the logprobs, got shape "
                         f"{list(ids.shape)}")
    _check_ids(ids, "responses", mask)
    return ids


def _prompt_tails(value: Any, batch: int) -> list[list[int]] | None:
    """The last `PROMPT_TAIL` ids of each row's prompt (None without prompts)."""
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
    for i, row in enumerate(rows):  # left padding (before the first real id) may hold any id
        real = np.cumsum(row >= 0) > 0 if row.dtype.kind == "i" else None
        _check_ids(row, f"prompts[{i}]", real)
    return [[int(t) for t in row[-PROMPT_TAIL:]] for row in rows]


def _check_ids(ids: np.ndarray, name: str, valid: np.ndarray | None = None) -> None:
    if ids.size and ids.dtype.kind not in "iu":
        raise InputError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    at = negative_id(ids, valid)
    if at is not None:
        raise InputError(f"{name}{list(at)} is {ids[at]}, a negative token id at a real token; ids are >= 0 "
                         "(one stored in a narrow integer type wraps): pass the ids the rollout sampled")
