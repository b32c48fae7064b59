"""The MoE router patch point: every router call of a patched model goes through `route`.

`ROUTERS` has one `RouterSpec` per HF router class (softmax: Qwen3-MoE, Mixtral; DeepSeek-V3
grouped sigmoid); `patch_router` refuses others. `route` runs through `parity.kernels.ops`;
`capture()` records chosen experts int32 `[tokens, moe_layers, top_k]`, and `run_routed` forces
given experts (verl's router replay), gate weights recomputed from the router's own scores or
replayed.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from parity.core.errors import ConfigError, InputError
from parity.core.schema import NO_REPLAY, REPLAY_MODES, ReplayMode
from parity.kernels import ops


@dataclass(frozen=True)
class RouterSpec:
    """How one HF router class scores experts, picks the top k and weighs them.

    score: "softmax" (fp32 softmax; top-k probabilities are the weights) or "sigmoid" (DeepSeek-V3:
    pick by score + `e_score_correction_bias` among the best `topk_group` of `n_group` groups, weights
    the plain scores times `routed_scaling_factor`). normalize_attr: renormalization switch (None:
    always). weights_in_logits_dtype: cast weights back (Qwen3-MoE) or keep fp32.
    """

    score: Literal["softmax", "sigmoid"]
    normalize_attr: str | None
    weights_in_logits_dtype: bool

    def __post_init__(self) -> None:
        if self.score not in ("softmax", "sigmoid"):
            raise ConfigError(f"RouterSpec.score must be 'softmax' or 'sigmoid', got {self.score!r}")


#: The one patch point of each supported router type, by HF class name.
ROUTERS: dict[str, RouterSpec] = {
    # class name:          (score,     normalize_attr,   weights_in_logits_dtype)
    "Qwen3MoeTopKRouter": RouterSpec("softmax", "norm_topk_prob", True),
    "MixtralTopKRouter": RouterSpec("softmax", None, False),
    "DeepseekV3TopkRouter": RouterSpec("sigmoid", "norm_topk_prob", False),
}

WeightsMode = Literal["recompute", "replay"]
WEIGHTS_MODES: tuple[str, ...] = ("recompute", "replay")


@dataclass(frozen=True)
class RouterReplay:
    """Router replay in the training forward: "R3" forces the rollout's experts; "R2" forces the
    experts of a first forward of the same micro-batch (verl's R2). weights: "recompute" (verl,
    slime) or "replay" (R2 only: Rollouts carry ids only).
    """

    mode: ReplayMode = "R3"
    weights: WeightsMode = "recompute"

    def __post_init__(self) -> None:
        if self.mode not in REPLAY_MODES:
            raise ConfigError(f"router_replay mode must be one of {REPLAY_MODES}, got {self.mode!r}")
        if self.weights not in WEIGHTS_MODES:
            raise ConfigError(f"router_replay weights must be one of {WEIGHTS_MODES}, got {self.weights!r}")
        if self.mode == "R3" and self.weights == "replay":
            raise ConfigError("router_replay R3 forces a rollout's routed_experts, which hold expert ids "
                              "only; use weights='recompute' with R3, or mode='R2' to replay weights too")

    @classmethod
    def of(cls, value: str | RouterReplay | None) -> RouterReplay | None:
        """None/"none" -> None (no replay); "R2"/"R3" -> that mode with recomputed weights."""
        if value is None or isinstance(value, RouterReplay):
            return value
        if value == NO_REPLAY:
            return None
        if value not in REPLAY_MODES:
            raise ConfigError(f"router_replay must be None, 'none', one of {REPLAY_MODES} or a "
                              f"parity RouterReplay, got {value!r}")
        return cls(mode=value)


class RouteRecorder:
    """Experts and gate weights each MoE layer chose during the forwards inside a `capture()` block."""

    def __init__(self, num_moe_layers: int) -> None:
        self.num_moe_layers = num_moe_layers
        self._ids: list[list[torch.Tensor]] = [[] for _ in range(num_moe_layers)]
        self._weights: list[list[torch.Tensor]] = [[] for _ in range(num_moe_layers)]

    def record(self, moe_layer: int, indices: torch.Tensor, weights: torch.Tensor) -> None:
        # kept as given, cast once for all layers in `routes`/`weights`: two launches per step
        # instead of two per layer inside a decode graph (the casts are exact either way)
        self._ids[moe_layer].append(indices.detach())
        self._weights[moe_layer].append(weights.detach())

    def routes(self) -> torch.Tensor:
        """[tokens, moe_layers, top_k] int32, tokens in forward order (flattened [batch, seq])."""
        return _by_layer(self._ids).to(torch.int32)

    def weights(self) -> torch.Tensor:
        """[tokens, moe_layers, top_k] float32 gate weights as the experts received them."""
        return _by_layer(self._weights).to(torch.float32)


def _by_layer(calls: list[list[torch.Tensor]]) -> torch.Tensor:
    """Each layer's calls [rows, k] in order, layers stacked on dim 1: [tokens, layers, k]."""
    return torch.stack([c[0] if len(c) == 1 else torch.cat(c) for c in calls], dim=1)


@dataclass(frozen=True, eq=False)
class ForcedRoutes:
    """Experts [rows, moe_layers, top_k] int64 to force by forward row; rows where `mask` [rows] is False
    route freely; weights float32 to force too, or None to recompute.
    """

    experts: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor | None = None

    @classmethod
    def from_spans(cls, rows: int, spans: Sequence[tuple[int, torch.Tensor]], device: str) -> ForcedRoutes:
        """spans: (first row, expert ids [n, moe_layers, top_k]) of each sequence in the forward."""
        layers, k = spans[0][1].shape[1:]
        experts = torch.zeros((rows, layers, k), dtype=torch.int64)
        mask = torch.zeros(rows, dtype=torch.bool)
        for first, ids in spans:
            experts[first:first + ids.shape[0]] = ids
            mask[first:first + ids.shape[0]] = True
        return cls(experts.to(device), mask.to(device))

    @classmethod
    def recorded(cls, recorder: RouteRecorder, with_weights: bool) -> ForcedRoutes:
        """Every row of a recorded forward, with its gate weights if `with_weights`."""
        experts = recorder.routes().to(torch.int64)
        return cls(experts, torch.ones(experts.shape[0], dtype=torch.bool, device=experts.device),
                   recorder.weights() if with_weights else None)

    def apply(self, moe_layer: int, weights: torch.Tensor, indices: torch.Tensor,
              weigh: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, indices) [rows, k] of one layer with the forced rows substituted (`weigh` recomputes)."""
        if self.experts.shape[0] != indices.shape[0]:
            raise InputError(f"router replay has routes for {self.experts.shape[0]} tokens but the forward "
                             f"routes {indices.shape[0]}")
        ids = self.experts[:, moe_layer]
        if self.weights is not None:
            forced = self.weights[:, moe_layer]
        else:
            forced, ids = weigh(ids)
        mask = self.mask[:, None]
        return torch.where(mask, forced, weights), torch.where(mask, ids, indices)


_recorder: RouteRecorder | None = None
_forced: ForcedRoutes | None = None


@contextmanager
def capture(num_moe_layers: int) -> Iterator[RouteRecorder]:
    """Record every router decision made inside the block (after any forcing)."""
    global _recorder
    previous, _recorder = _recorder, RouteRecorder(num_moe_layers)
    try:
        yield _recorder
    finally:
        _recorder = previous


@contextmanager
def forcing(forced: ForcedRoutes) -> Iterator[None]:
    """Every router call inside the block takes its decisions for the forced rows from `forced`."""
    global _forced
    previous, _forced = _forced, forced
    try:
        yield
    finally:
        _forced = previous


def route(router: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF router signature: hidden [..., H] -> (logits [N, E], weights [N, k], expert ids [N, k])."""
    spec = ROUTERS[type(router).__name__]
    rows = hidden.reshape(-1, router.hidden_dim)
    normalize = True if spec.normalize_attr is None else bool(getattr(router, spec.normalize_attr))
    if spec.score == "softmax":
        logits = ops.linear(rows, router.weight)
        # Routing probabilities in fp32, as every HF router does.
        probs = ops.softmax(logits.to(torch.float32))
        weights, indices = ops.topk(probs, router.top_k, normalize=normalize)

        def weigh(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # Running the k picked probabilities through ops.topk renormalizes them with the very
            # op (and summation order) the router's own choice uses, so forcing the experts the
            # router would pick anyway changes no bit.
            picked, order = ops.topk(probs.gather(1, ids), ids.shape[1], normalize=normalize)
            return picked, ids.gather(1, order)
    else:
        logits = ops.linear(rows.to(torch.float32), router.weight.to(torch.float32))
        scores = ops.activation(torch.sigmoid, logits)
        indices = _grouped_choice(router, scores)

        def weigh(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            picked = scores.gather(1, ids)
            if normalize:
                # a sum of k <= 8 values per row: no thread splits it, so it is batch-invariant
                picked = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20)
            return picked * router.routed_scaling_factor, ids

        weights, _ = weigh(indices)
    if _forced is not None:
        weights, indices = _forced.apply(router.parity_moe_layer, weights, indices, weigh)
    if spec.weights_in_logits_dtype:
        weights = weights.to(logits.dtype)
    if _recorder is not None:
        _recorder.record(router.parity_moe_layer, indices, weights)
    return logits, weights, indices


def _grouped_choice(router: nn.Module, scores: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's choice: [N, E] scores -> [N, k] ids among the top `topk_group` groups."""
    choice = scores + router.e_score_correction_bias
    n, experts = choice.shape
    per_group = experts // router.num_group
    top2, _ = ops.topk(choice.view(n, router.num_group, per_group), 2)
    _, best = ops.topk(top2.sum(dim=-1), router.topk_group)
    keep = torch.zeros((n, router.num_group), dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    return ops.topk(choice, router.top_k)[1]


def patch_router(router: nn.Module, moe_layer: int) -> None:
    """Send `router`'s calls through `route`; `moe_layer` is its index among the MoE layers."""
    if type(router).__name__ not in ROUTERS:
        raise ConfigError(
            f"MoE router {type(router).__name__} is not supported; parity knows {sorted(ROUTERS)} "
            f"(add a RouterSpec to parity/models/routing.py)"
        )
    router.parity_moe_layer = moe_layer
    router.forward = types.MethodType(route, router)


def run_routed(run: Callable[[], torch.Tensor], num_moe_layers: int, *, replay: RouterReplay | None = None,
               spans: Sequence[tuple[int, torch.Tensor]] = (), rows: int = 0, device: str = "cpu",
               record: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`run()` under router replay: R3 forces each span's experts; R2 runs twice, forcing the first
    run's choices. Returns the result and int32 experts [rows, moe_layers, top_k] if `record`.
    """
    forced = None
    if replay is not None and replay.mode == "R2":
        with capture(num_moe_layers) as first:
            run()
        forced = ForcedRoutes.recorded(first, with_weights=replay.weights == "replay")
    elif replay is not None:
        forced = ForcedRoutes.from_spans(rows, spans, device)
    with ExitStack() as stack:
        if forced is not None:
            stack.enter_context(forcing(forced))
        recorder = stack.enter_context(capture(num_moe_layers)) if record else None
        result = run()
    return result, None if recorder is None else recorder.routes()
