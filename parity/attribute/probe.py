"""Inside the engine: where a production engine's numbers leave the training forward's, stage by stage.

    from parity.attribute import EngineSide, engine_diff
    diff = engine_diff("tiny-llama", requests)                     # vLLM against the training forward
    diff.phase("decode").first_differing                           # e.g. "layer.0.attn"
    diff = engine_diff("tiny-llama", requests, side=EngineSide(batch=1), against=EngineSide())
    diff = engine_diff("tiny-llama", requests, side=EngineSide(fillers=56), against=EngineSide(batch=1))
    diff = engine_diff("tiny-qwen3-moe", requests, replay_routes=True)  # R3: the engine's experts

Side B is the engine with its probe on (`parity.backends.vllm_probe`); side A the training forward
over the engine's own tokens, or the same engine in another setting (`EngineSide`). Rows are compared
position by position, per phase: prefill (the prompt; the first logits row) and decode (where a
rollout's logprobs come from), each sequence up to the first token the sides disagree on.
`replay_routes=True` (MoE) makes the training forward use the engine's experts (R3).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from parity.attribute.layers import StageDiff
from parity.attribute.runner import run
from parity.attribute.settings import Setting
from parity.attribute.stages import check_stage_kinds, stage_kind, stage_rank
from parity.backends import Backend, backend_options, check_probe, check_requests, get_backend, shared_backend
from parity.core.errors import ConfigError, InputError, UnsupportedError
from parity.core.types import Request, Rollout
from parity.models.checkpoints import resolve_model
from parity.models.lora import is_moe_checkpoint
from parity.workload.neighbours import spread

#: backends whose engine parity can look into.
PROBE_BACKENDS: tuple[str, ...] = ("vllm", "vllm-server", "sglang")
#: backends whose probe runs one sample at a time (SGLang dumps per forward pass, not per request).
ONE_AT_A_TIME: tuple[str, ...] = ("sglang",)
#: the two phases of a rollout, compared separately.
PHASES: tuple[str, ...] = ("prefill", "decode")


@dataclass(frozen=True)
class EngineSide:
    """One setting of the engine: its backend options (besides `probe`), the requests per call
    (`batch`; None: all in one call) and `fillers`, uncaptured requests of other prompt lengths spread
    among each call's requests (the audit's batch check: steps that mix one request's decode with
    another's prefill)."""

    options: Mapping[str, Any] = field(default_factory=dict)
    batch: int | None = None
    fillers: int = 0

    def __post_init__(self) -> None:
        if self.batch is not None and (isinstance(self.batch, bool) or not isinstance(self.batch, int)
                                       or self.batch < 1):
            raise ConfigError(f"EngineSide.batch must be an integer >= 1 or None (all requests in one call), "
                              f"got {self.batch!r}")
        if isinstance(self.fillers, bool) or not isinstance(self.fillers, int) or self.fillers < 0:
            raise ConfigError(f"EngineSide.fillers must be an integer >= 0, got {self.fillers!r}")
        if not isinstance(self.options, Mapping) or "probe" in self.options:
            raise ConfigError("EngineSide.options must be a mapping of backend options without 'probe' "
                              "(the probe is always on)")
        object.__setattr__(self, "options", dict(self.options))

    @property
    def label(self) -> str:
        batch = "all requests in one call" if self.batch is None else f"{self.batch} request(s) per call"
        options = ", ".join(f"{k}={v!r}" for k, v in sorted(self.options.items()))
        fillers = f" among {self.fillers} fillers" if self.fillers else ""
        return f"{batch}{fillers}{'; ' + options if options else ''}"


@dataclass(frozen=True)
class PhaseDiff:
    """The `StageDiff`s of one phase ("prefill" or "decode"), in forward order."""

    phase: str
    stages: tuple[StageDiff, ...]

    @property
    def first_differing(self) -> str | None:
        return next((s.stage for s in self.stages if s.differing), None)

    @property
    def depth(self) -> list[float]:
        """Relative error of each decoder layer's output ("layer.<i>"), layer by layer."""
        return [s.rel_error for s in self.stages if stage_kind(s.stage) == "layer"]

    @property
    def growth(self) -> float | None:
        """Relative error of the last layer's output over the first differing layer's; None if no layer
        output differs, NaN if the first differing one's error is not finite (NaN/inf: no ratio)."""
        layers = [s for s in self.stages if stage_kind(s.stage) == "layer"]
        first = next((s.rel_error for s in layers if s.differing), None)  # a NaN error is not skipped
        if first is None:
            return None
        return layers[-1].rel_error / first if math.isfinite(first) and first > 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "first_differing": self.first_differing, "depth": self.depth,
                "growth": self.growth,
                "stages": [{**s.to_dict(), "share": s.differing / s.elements if s.elements else 0.0}
                           for s in self.stages]}


@dataclass(frozen=True)
class EngineDiff:
    """The result of `engine_diff`: side B (the engine) against side A, per phase. parted: how many
    captured samples the sides sampled different tokens for; positions: rows compared per phase."""

    model: str
    backend: str
    side_a: str
    side_b: str
    sequences: tuple[int, ...]
    parted: int
    positions: dict[str, int]
    phases: tuple[PhaseDiff, ...]
    replay_routes: bool = False

    def phase(self, name: str) -> PhaseDiff:
        return next(p for p in self.phases if p.phase == name)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (what `parity.render.attribution.engine_html` draws)."""
        return {"model": self.model, "backend": self.backend, "side_a": self.side_a, "side_b": self.side_b,
                "sequences": list(self.sequences), "parted": self.parted, "positions": self.positions,
                "replay_routes": self.replay_routes, "phases": [p.to_dict() for p in self.phases]}


def check_probe_input(backend: str, requests: Sequence[Request], capture: Iterable[int] | None,
                      stages: Iterable[str] | str | None, sides: Sequence[EngineSide]
                      ) -> tuple[list[int], tuple[str, ...]]:
    """(capture indices, stage kinds), checked before any engine starts."""
    if backend not in PROBE_BACKENDS:
        raise UnsupportedError(f"backend {backend!r} has no engine probe; parity can look inside "
                               f"{list(PROBE_BACKENDS)} (the other backends give logprobs only)")
    if not requests:
        raise InputError("requests is empty; give at least one parity.Request")
    valid = set(backend_options(backend))
    for side in sides:
        unknown = sorted(set(side.options) - valid)
        if unknown:
            raise ConfigError(f"backend {backend!r} has no option(s) {unknown}; its options: {sorted(valid)}")
        if backend in ONE_AT_A_TIME and (side.batch is not None or side.fillers):
            raise ConfigError(f"backend {backend!r} is probed one sample at a time (its tensor dumps are "
                              "per forward pass, not per request): drop batch/fillers (--versus batch, "
                              "--fillers)")
    kinds = check_stage_kinds(stages)
    samples = sum(r.sampling.n for r in requests)
    given = None if capture is None or isinstance(capture, (str, bytes)) else list(capture)
    whole = (isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in given or ())
    if capture is not None and (given is None or not all(whole)):
        raise InputError(f"capture must be sample indices (integers), got {capture!r}")
    chosen = list(range(samples)) if given is None else [int(i) for i in given]
    bad = [i for i in chosen if not 0 <= i < samples]
    if bad or not chosen:
        raise InputError(f"capture: sample indices must lie in 0..{samples - 1} (one per sample of the "
                         f"{len(requests)} requests); got {bad or chosen}")
    for side in sides:  # last: a missing engine package is named only once the input is right
        check_requests(backend, requests, dict(side.options))
        check_probe(backend, requests, sorted(set(chosen)), kinds, dict(side.options))
    return sorted(set(chosen)), kinds


@dataclass(frozen=True)
class EngineProbe:
    """One engine setting's rollouts and, per captured sample, {stage: [rows, width]} in its dtype."""

    label: str
    rollouts: tuple[Rollout, ...]
    states: dict[int, dict[str, torch.Tensor]]


def probe_engine(engine: Backend, requests: Sequence[Request], capture: Sequence[int], kinds: Sequence[str],
                 *, batch: int | None = None, fillers: int = 0, label: str = "engine") -> EngineProbe:
    """Sample `requests` on a running probe engine (`batch` requests per call, None: all in one; each
    call among `fillers` uncaptured requests) and capture the stage kinds `kinds` of the samples
    `capture`. The fillers' rollouts are dropped: the result holds the samples of `requests` only."""
    if not hasattr(engine, "probe"):
        raise UnsupportedError(f"backend {engine.name!r} has no engine probe; parity can look inside "
                               f"{list(PROBE_BACKENDS)}")
    size = batch or len(requests)
    rollouts: list[Rollout] = []
    states: dict[int, dict[str, torch.Tensor]] = {}
    for first in range(0, len(requests), size):
        part = list(requests[first:first + size])
        offset = len(rollouts)
        call, where = among_fillers(part, fillers, seed=first)
        local = [i - offset for i in capture if offset <= i < offset + len(where)]
        got, captured = engine.probe(call, [where[i] for i in local], kinds)
        back = {w: k for k, w in enumerate(where)}
        rollouts += [got[w] for w in where]
        states.update({offset + back[i]: s for i, s in captured.items()})
    return EngineProbe(label=label, rollouts=tuple(rollouts), states=states)


def among_fillers(part: Sequence[Request], fillers: int, *, seed: int = 0) -> tuple[list[Request], list[int]]:
    """`part` spread evenly among `fillers` requests (n=1, the first request's sampling), as the audit's
    batch check builds its batches (`parity.workload.neighbours.spread`); returns the call and, per
    sample of `part` in order, its sample index in the call."""
    items = spread(part, len(part) + fillers, np.random.Generator(np.random.PCG64(seed))) if fillers else part
    call: list[Request] = []
    where: list[int] = []
    samples = 0
    for position, item in enumerate(items):
        if isinstance(item, Request):
            where += range(samples, samples + item.sampling.n)
        else:
            item = Request(item, part[0].sampling.replace(n=1), f"parity-filler-{seed}-{position}")
        call.append(item)
        samples += item.sampling.n
    return call, where


def engine_diff(model: str, requests: Sequence[Request], *, backend: str = "vllm", dtype: str = "bfloat16",
                side: EngineSide | None = None, against: EngineSide | None = None,
                capture: Iterable[int] | None = None, stages: Iterable[str] | str | None = None,
                train: Setting | None = None, shared: bool = False, replay_routes: bool = False
                ) -> EngineDiff:
    """Stage-by-stage differences of the engine (`side`) from the training forward (`train`, default
    `Setting(dtype=dtype)`), or from the same engine in the setting `against`. shared: the process's
    shared engines; otherwise one engine runs at a time. Bad input is refused before any start.
    """
    side = side or EngineSide()
    if against is not None and train is not None:
        raise ConfigError("train sets the training forward (side A when against is None); with against= side "
                          "A is the engine in that setting, so train would be ignored: drop one of them")
    chosen, kinds = check_probe_input(backend, requests, capture, stages,
                                      [side] if against is None else [side, against])
    if replay_routes:
        check_replay(model, against)
    train = train or Setting(dtype=dtype)
    if not isinstance(train, Setting) or train.mode != "prefill":
        raise ConfigError("train must be a prefill parity.attribute.Setting (the training forward)")
    start: Callable[..., Backend] = shared_backend if shared else get_backend
    running: list[tuple[dict[str, Any], Backend]] = []  # one engine at a time; reused for equal options

    def probe_side(setting: EngineSide) -> EngineProbe:
        if not running or running[0][0] != setting.options:
            if running and not shared:
                running.pop()[1].close()
            engine = start(backend, model, dtype=dtype, probe=True, **setting.options)
            running[:] = [(setting.options, engine)]
        label = setting.label if backend not in ONE_AT_A_TIME else \
            setting.label.replace("all requests in one call", "one sample per call")
        return probe_engine(running[0][1], requests, chosen, kinds, batch=setting.batch,
                            fillers=setting.fillers, label=f"{backend}: {label}")

    try:
        b = probe_side(side)
        a = train_probe(model, b, train, kinds, replay_routes=replay_routes) if against is None \
            else probe_side(against)
    finally:
        if running and not shared:
            running[0][1].close()
    return dataclasses.replace(compare_probes(model, backend, a, b), replay_routes=replay_routes)


def check_replay(model: str, against: EngineSide | None) -> None:
    """ConfigError unless route replay can apply: the training forward as side A, an MoE model."""
    if against is not None:
        raise ConfigError("replay_routes replays the engine's experts in the training forward; it does not "
                          "apply to engine against engine (drop against= / --versus)")
    if not is_moe_checkpoint(resolve_model(model)):
        raise ConfigError(f"replay_routes needs an MoE model (routes to replay); {model!r} is dense")


def train_probe(model: str, engine: EngineProbe, train: Setting, kinds: Sequence[str], *,
                replay_routes: bool = False) -> EngineProbe:
    """The training forward (a prefill) over the engine's captured samples, the same stages captured;
    `replay_routes` forces each rollout's `routed_experts` (R3)."""
    chosen = sorted(engine.states)
    rollouts = [engine.rollouts[i] for i in chosen]
    pairs = [(list(r.prompt_ids), list(r.token_ids)) for r in rollouts]
    routes = None
    if replay_routes:
        missing = [i for i, r in zip(chosen, rollouts) if getattr(r, "routed_experts", None) is None]
        if missing:
            raise UnsupportedError(f"the engine returned no MoE routes for samples {missing}; replay_routes "
                                   "needs an MoE model on a backend whose probe captures routes (vllm)")
        routes = [r.routed_experts for r in rollouts]
    states = run(model, pairs, train, capture=True, stages=kinds, routes=routes).states
    label = f"training forward: {train.label}{' · R3: the engine experts replayed' if replay_routes else ''}"
    return EngineProbe(label=label, rollouts=engine.rollouts,
                       states={i: {name: states[name][n] for name in states} for n, i in enumerate(chosen)})


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_probes(model: str, backend: str, a: EngineProbe, b: EngineProbe) -> EngineDiff:
    """Side B's captured stages against side A's, row by row, per phase."""
    chosen = sorted(b.states)
    if sorted(a.states) != chosen or not chosen:
        raise InputError(f"the two probes captured different samples: {sorted(a.states)} and {chosen}")
    rollouts_a, states_a, rollouts_b, states_b = a.rollouts, a.states, b.rollouts, b.states
    names = sorted(states_b[chosen[0]], key=stage_rank)  # forward order, whatever order B stored
    parts: dict[str, dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]] = {
        phase: {name: ([], []) for name in names} for phase in PHASES}
    positions = dict.fromkeys(PHASES, 0)
    parted = 0
    for i in chosen:
        ra, rb = rollouts_a[i], rollouts_b[i]
        if list(ra.prompt_ids) != list(rb.prompt_ids):
            raise InputError(f"sample {i}: the two sides' prompts differ ({len(ra.prompt_ids)} and "
                             f"{len(rb.prompt_ids)} tokens), so its rows are of different requests: probe "
                             "the same requests in the same order on both sides")
        stages = set(names) | set(states_a[i]) | set(states_b[i])
        lacking = {side: sorted(stages - set(got[i])) for side, got in (("A", states_a), ("B", states_b))}
        if any(lacking.values()):
            raise UnsupportedError(f"sample {i}: the two sides captured different stages (side A lacks "
                                   f"{lacking['A']}, side B lacks {lacking['B']}); a stage one side never "
                                   "captured cannot be compared (choose the stages both have with stages=)")
        prompt = len(rb.prompt_ids)
        same = _common(ra.token_ids, rb.token_ids)
        parted += same < max(len(ra.token_ids), len(rb.token_ids))
        for name in names:
            # token row p was fed token p; logits row t was computed from the tokens before response[t]
            logits = name == "logits"
            want = same + 1 if logits else prompt + same
            for side, x, r in (("A", states_a[i][name], ra), ("B", states_b[i][name], rb)):
                fed = len(r.token_ids) if logits else prompt + max(len(r.token_ids) - 1, 0)
                if x.shape[0] < min(want, fed):
                    raise UnsupportedError(
                        f"stage {name!r} of sample {i}: side {side} captured {x.shape[0]} rows of the "
                        f"{min(want, fed)} its tokens {'sampled' if logits else 'fed'}; an incomplete "
                        "capture (hooks that did not run, e.g. in a CUDA graph) cannot be compared by row")
            n = min(want, states_a[i][name].shape[0], states_b[i][name].shape[0])
            split = min(1 if logits else prompt, n)
            xa, xb = states_a[i][name][:n], states_b[i][name][:n]
            if xa.shape != xb.shape:
                raise UnsupportedError(f"stage {name!r} of sample {i}: side A has shape {tuple(xa.shape)}, "
                                       f"side B {tuple(xb.shape)}; the two cannot be compared row by row")
            for phase, rows in (("prefill", slice(0, split)), ("decode", slice(split, n))):
                parts[phase][name][0].append(xa[rows])
                parts[phase][name][1].append(xb[rows])
            if name == names[0]:
                positions["prefill"] += split
                positions["decode"] += n - split
    phases = tuple(PhaseDiff(phase, tuple(StageDiff.between(name, *parts[phase][name]) for name in names))
                   for phase in PHASES)
    return EngineDiff(model=model, backend=backend, side_a=a.label, side_b=b.label, sequences=tuple(chosen),
                      parted=parted, positions=positions, phases=phases)
