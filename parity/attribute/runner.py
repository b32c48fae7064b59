"""Run fixed sequences through the forward the way one `Setting` says: logprobs and, on request,
the hidden state of every token after every stage of the model.

Prefill settings call `train_forward` itself per micro-batch (exactly the trainer's numbers); decode
teacher-forces one packed token per sequence per step against the KV cache, as the reference engine.
Logprobs are raw: top-k/top-p truncation would turn a tiny logit difference into an infinite logprob
difference at the support boundary. Hooks scatter each forward's rows back to (sequence, position).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from parity import kernels as _kernels
from parity.attribute.settings import Setting
from parity.attribute.stages import check_stage_kinds, stage_order
from parity.core.errors import ConfigError, InputError
from parity.core.types import Pair, Sequences, as_pairs
from parity.engine import forward, sampler, train_forward
from parity.engine.inputs import check_length, check_token_ids
from parity.kernels.attention import KVCache
from parity.models.loading import LoadedModel, load_model

#: where one forward's output rows go: (sequence index, flat output rows [n], its positions [n]);
#: both are consecutive runs (aranges), so a sequence's rows are copied as one slice.
RowMap = list[tuple[int, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Run:
    """What one setting computed for every sequence: raw logprobs (nats, float32 [len(response)]) and,
    when captured, stage -> per sequence [len(prompt) + len(response), width] in the model dtype
    ([len(response), vocab] for "logits")."""

    logprobs: tuple[torch.Tensor, ...]
    states: dict[str, tuple[torch.Tensor, ...]]


#: the stage kinds the layer probe captures unless told otherwise.
DEFAULT_KINDS = ("embed", "layer", "norm", "logits")


def moe_layers(lm: LoadedModel) -> list[int]:
    """Indices of the decoder layers whose MLP has a router (`mlp.gate`)."""
    layers = lm.model.model.layers
    return [i for i, layer in enumerate(layers) if hasattr(getattr(layer, "mlp", None), "gate")]


def stage_names(lm: LoadedModel, kinds: Iterable[str] = DEFAULT_KINDS) -> list[str]:
    """Stages of `kinds` in forward order (`parity.attribute.stages.stage_order`)."""
    return stage_order(kinds, len(lm.model.model.layers), moe_layers(lm))


def run(model: str | LoadedModel, sequences: Sequences, setting: Setting, *, capture: bool = False,
        stages: Iterable[str] | None = None, routes: Sequence[np.ndarray] | None = None) -> Run:
    """The forward of `setting` over `sequences`; with `capture`, the stage kinds `stages` too.
    routes: per sequence int `[len(prompt) + len(response) - 1, moe_layers, top_k]`, replayed R3."""
    kinds = DEFAULT_KINDS if stages is None else check_stage_kinds(stages)
    pairs = as_pairs(sequences)
    if not pairs:
        raise InputError("sequences is empty; give a non-empty list of parity.Rollout or (prompt_ids, "
                         "response_ids) pairs")
    if routes is not None and (setting.mode != "prefill" or len(routes) != len(pairs)):
        raise ConfigError(f"routes are replayed in a prefill setting, one array per sequence; got "
                          f"{len(routes)} for {len(pairs)} sequences in mode {setting.mode!r}")
    lm = load_model(model, dtype=setting.dtype, device=setting.device)
    for i, (prompt, response) in enumerate(pairs):
        check_token_ids(prompt + response, lm, f"sequences[{i}]")
        check_length(len(prompt) + len(response), lm, f"sequences[{i}]")
    size = setting.micro_batch_size or len(pairs)
    recorder = _Recorder(lm, pairs, kinds) if capture else None
    micro_batch = _prefill if setting.mode == "prefill" else _decode
    logprobs: list[torch.Tensor] = []
    with recorder.hooks() if recorder else nullcontext():
        for start in range(0, len(pairs), size):
            indices = range(start, min(len(pairs), start + size))
            if routes is None:
                logprobs.extend(micro_batch(lm, pairs, indices, setting, recorder))
            else:
                logprobs.extend(_prefill(lm, pairs, indices, setting, recorder, [routes[i] for i in indices]))
    return Run(logprobs=tuple(logprobs), states=recorder.states() if recorder else {})


def _prefill(lm: LoadedModel, pairs: list[Pair], indices: range, setting: Setting,
             recorder: _Recorder | None, routes: list[np.ndarray] | None = None) -> list[torch.Tensor]:
    """One training-forward call on the micro-batch `indices`, laid out as `setting.layout`."""
    part = [pairs[i] for i in indices]
    if recorder is not None:
        recorder.expect(_layout_rows(part, indices, setting.layout), _response_rows(part, indices))
    replay = {} if routes is None else {"router_replay": "R3", "routes": routes}
    return train_forward(lm, part, dtype=setting.dtype, device=setting.device, kernels=setting.kernels,
                         layout=setting.layout, logprobs_mode="raw", **replay).logprobs


def _layout_rows(part: list[Pair], indices: range, layout: str) -> RowMap:
    """Flat rows of a [B, L] forward holding each sequence's tokens, as `train_forward` lays them out."""
    lengths = [len(p) + len(r) for p, r in part]
    width = max(lengths)
    rows: RowMap = []
    offset = 0
    for b, (seq, length) in enumerate(zip(indices, lengths)):
        if layout == "packed":
            first = offset
            offset += length
        else:
            first = b * width + (0 if layout == "right" else width - length)
        rows.append((seq, torch.arange(first, first + length), torch.arange(length)))
    return rows


def _response_rows(part: list[Pair], indices: range) -> RowMap:
    """lm_head input rows of a micro-batch: every response token's row, sequence by sequence."""
    rows: RowMap = []
    offset = 0
    for seq, (_, response) in zip(indices, part):
        rows.append((seq, torch.arange(offset, offset + len(response)), torch.arange(len(response))))
        offset += len(response)
    return rows


@dataclass
class _Step:
    """One packed decode step: the [T] token ids, positions and KV slots fed, where their rows go,
    and (index in the micro-batch, row) of every sequence whose next response token it scores."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    token_rows: RowMap
    predicting: list[tuple[int, int]]


def _pack_step(part: list[Pair], indices: range, step: int) -> _Step:
    """Step 0 feeds every whole prompt; step t >= 1 response token t - 1 of each sequence that has it."""
    packed = _Step(ids=[], positions=[], slots=[], token_rows=[], predicting=[])
    for b, (prompt, response) in enumerate(part):
        if step == 0:
            fed, start = prompt, 0
        elif step <= len(response):
            fed, start = response[step - 1:step], len(prompt) + step - 1
        else:
            continue
        first = len(packed.ids)
        packed.token_rows.append((indices[b], torch.arange(first, first + len(fed)),
                                  torch.arange(start, start + len(fed))))
        packed.ids.extend(fed)
        packed.positions.extend(range(start, start + len(fed)))
        packed.slots.extend([b] * len(fed))
        if step < len(response):
            packed.predicting.append((b, len(packed.ids) - 1))
    return packed


def _decode(lm: LoadedModel, pairs: list[Pair], indices: range, setting: Setting,
            recorder: _Recorder | None) -> list[torch.Tensor]:
    """Teacher-forced decode of the micro-batch `indices`, one packed [1, T] forward per step; the last
    response token is fed too, so every position has a hidden state to compare with a prefill."""
    part = [pairs[i] for i in indices]
    device = lm.device
    longest = max(len(p) + len(r) for p, r in part)
    cache = KVCache.allocate(lm.config, len(part), longest, lm.torch_dtype, device)
    scores: list[list[torch.Tensor]] = [[] for _ in part]
    with torch.inference_mode(), _kernels.invariant(setting.kernels):
        for step in range(max(len(r) for _, r in part) + 1):
            packed = _pack_step(part, indices, step)
            if recorder is not None:
                recorder.expect(packed.token_rows, [(indices[b], torch.tensor([n]), torch.tensor([step]))
                                                    for n, (b, _) in enumerate(packed.predicting)])
            hidden = forward.final_hidden(lm, torch.tensor([packed.ids], device=device),
                                          torch.tensor([packed.positions], device=device), cache,
                                          torch.tensor(packed.slots, device=device))
            if not packed.predicting:
                continue
            logits = forward.logits(lm, hidden[[row for _, row in packed.predicting]])
            targets = torch.tensor([[part[b][1][step]] for b, _ in packed.predicting], device=logits.device)
            picked = sampler.raw_logprobs(logits).gather(1, targets).squeeze(1).to(torch.float32).cpu()
            for (b, _), value in zip(packed.predicting, picked):
                scores[b].append(value)
    return [torch.stack(s) if s else torch.zeros(0) for s in scores]


class _Recorder:
    """Forward hooks that copy each stage's output rows to per-sequence buffers, where the last
    `expect` said this forward's token and lm_head rows belong."""

    def __init__(self, lm: LoadedModel, pairs: list[Pair], kinds: Iterable[str]) -> None:
        self.lm = lm
        self.pairs = pairs
        self.buffers: dict[str, list[torch.Tensor | None]] = {name: [None] * len(pairs)
                                                              for name in stage_names(lm, kinds)}
        self.token_rows: RowMap = []
        self.logit_rows: RowMap = []

    def expect(self, token_rows: RowMap, logit_rows: RowMap) -> None:
        self.token_rows, self.logit_rows = token_rows, logit_rows

    @contextmanager
    def hooks(self) -> Iterator[None]:
        inner = self.lm.model.model
        modules: list[tuple[str, nn.Module]] = [("embed", inner.embed_tokens), ("norm", inner.norm),
                                                ("logits", self.lm.model.lm_head)]
        for i, layer in enumerate(inner.layers):
            modules += [(f"layer.{i}", layer), (f"layer.{i}.attn", layer.self_attn),
                        (f"layer.{i}.mlp", layer.mlp)]
            if hasattr(layer.mlp, "gate"):
                modules.append((f"layer.{i}.router", layer.mlp.gate))
        handles = [module.register_forward_hook(self._hook(name)) for name, module in modules
                   if name in self.buffers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            self._store(name, out.reshape(-1, out.shape[-1]))
        return hook

    def _store(self, name: str, flat: torch.Tensor) -> None:
        """Copy rows of a [rows, width] stage output into the sequences' [positions, width] buffers."""
        buffers = self.buffers[name]
        for seq, rows, positions in self.logit_rows if name == "logits" else self.token_rows:
            n = len(rows)
            if not n:
                continue
            if buffers[seq] is None:
                prompt, response = self.pairs[seq]
                length = len(response) if name == "logits" else len(prompt) + len(response)
                buffers[seq] = torch.empty(length, flat.shape[-1], dtype=flat.dtype) if n == length \
                    else flat.new_zeros(length, flat.shape[-1], device="cpu")
            first, at = int(rows[0]), int(positions[0])
            buffers[seq][at:at + n].copy_(flat[first:first + n])

    def states(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """Stage -> per-sequence tensors; an empty [0, 0] tensor where a stage saw no row of a sequence."""
        return {name: tuple(torch.zeros(0, 0) if b is None else b for b in bufs)
                for name, bufs in self.buffers.items()}
