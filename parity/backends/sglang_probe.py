"""The engine probe for SGLang, read from its per-pass tensor dumps (`--debug-tensor-dump-output-folder`).

SGLang has no hook parity could run in its model worker; what it has is a debug dump: every leaf
module's output of every forward pass, one `PassNNNNN.pt` per pass and rank. A pass holds the whole
batch, so the probe sends one sample at a time: the passes written during a sample's request are its
prefill (one or more chunks) and its decode steps. The dump is written when the model's own forward
returns, so what runs after it (the model's output, the logits) lands in the NEXT pass's file; the
probe ends with one more request so the last sample's last logits reach the disk.

Stages (`parity.attribute.stages`), from SGLang's module names, rows per fed position:
embed <- model.embed_tokens; layer.i.attn <- ...self_attn.o_proj; layer.i.mlp <- ...mlp.down_proj;
layer.i <- the residual that layer i+1's input_layernorm (or model.norm) returns with a fused
add-RMSNorm, else (`--model-impl transformers`: separate adds, residual not dumped) the residual
rebuilt as (h + attn) + mlp in the dumped dtype, the model's own two adds (a Llama/Qwen-style
decoder: no scale on the embedding, no norm after attention or MLP); norm <- model.norm;
logits <- logits_processor (one row per pass: the next token's logits, float32 as SGLang keeps them).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from parity.core.errors import BackendError, UnsupportedError

#: why sampled logits cannot be probed on a CPU SGLang, and what to do instead.
SAMPLED_LOGITS = ("SGLang's sampler overwrote the dumped logits with probabilities (in place, before the "
                  "dump was written: on CPU its dump's .cpu() copies nothing): probe the logits with greedy "
                  "requests (temperature 0), or leave them out (--stages embed,attn,mlp,layer,norm)")
#: the server flags the probe adds: where to dump; no radix cache (a cached prefix would leave the
#: prompt's first positions out of the prefill pass); no overlap scheduler (on CUDA it launches one
#: more decode pass of a request before it sees the request finished: on the H200 a request of N
#: tokens dumped N + 1 logits rows, and that pass may land in the next request's files).
SERVER_FLAGS = ("--debug-tensor-dump-output-folder", "--disable-radix-cache", "--disable-overlap-schedule")


class PassDumps:
    """The dump folder of one SGLang server or Engine that parity started (removed by `close`)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="parity-sglang-dump-"))

    def server_args(self) -> list[str]:
        return [SERVER_FLAGS[0], str(self.root), *SERVER_FLAGS[1:]]

    def engine_kwargs(self) -> dict[str, Any]:
        return {"debug_tensor_dump_output_folder": str(self.root), "disable_radix_cache": True,
                "disable_overlap_schedule": True}

    def files(self) -> list[Path]:
        """Every pass file so far, in pass order (one rank: parity's SGLang runs at TP 1 here)."""
        ranks = sorted(p for p in self.root.iterdir() if p.is_dir())
        if len(ranks) > 1:
            raise UnsupportedError(f"the SGLang probe reads one rank's dumps; this engine wrote {len(ranks)} "
                                   "(tensor parallel): run it with tp_size 1")
        return sorted(ranks[0].glob("Pass*.pt")) if ranks else []

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _rows(value: Any, index: int = 0) -> torch.Tensor:
    """A dumped output as [tokens, width]: element `index` of a tuple output (fused add-RMSNorm returns
    (normed, residual)); a leading batch axis of 1 (`--model-impl transformers`) dropped."""
    tensor = value[index] if isinstance(value, list) else value
    return tensor.reshape(-1, tensor.shape[-1])


def _num_layers(names: Sequence[str]) -> int:
    return 1 + max(int(n.split(".")[2]) for n in names if n.startswith("model.layers."))


def pass_stages(modules: dict[str, Any], kinds: Sequence[str]) -> dict[str, torch.Tensor]:
    """One pass's module outputs as parity's token stages (every kind but logits), [tokens, width]."""
    layers = _num_layers(list(modules))
    out: dict[str, torch.Tensor] = {}
    if "embed" in kinds:
        out["embed"] = _rows(modules["model.embed_tokens"])
    hidden = _rows(modules["model.embed_tokens"])
    for i in range(layers):
        if f"model.layers.{i}.mlp.down_proj" not in modules:
            raise UnsupportedError(f"SGLang's dump of layer {i} has no mlp.down_proj: the SGLang probe maps "
                                   "dense decoder layers only (an MoE block's dump names are not mapped)")
        attn = _rows(modules[f"model.layers.{i}.self_attn.o_proj"])
        mlp = _rows(modules[f"model.layers.{i}.mlp.down_proj"])
        after = modules[f"model.layers.{i + 1}.input_layernorm"] if i + 1 < layers else modules["model.norm"]
        # fused add-RMSNorm returns (normed, residual): the residual is layer i's output as computed;
        # otherwise the model added twice in its dtype, which the same adds reproduce bit for bit
        hidden = _rows(after, 1) if isinstance(after, list) else (hidden + attn) + mlp
        for kind, name, value in (("attn", f"layer.{i}.attn", attn), ("mlp", f"layer.{i}.mlp", mlp),
                                  ("layer", f"layer.{i}", hidden)):
            if kind in kinds:
                out[name] = value
    if "norm" in kinds:
        out["norm"] = _rows(modules["model.norm"], 0)
    return out


def sample_stages(passes: Sequence[dict[str, Any]], following: dict[str, Any], prompt_len: int,
                  kinds: Sequence[str], response_len: int | None = None) -> dict[str, torch.Tensor]:
    """One sample's stages from the pass files written during its request (`passes`, in order) and
    the file after them (`following`), which holds the last pass's logits. Token stages: the rows of
    every pass concatenated (prefill chunks, then one row per decode step); logits: one row per pass
    that ended the prompt or decoded, i.e. one per response token (`response_len`, checked)."""
    if not passes:
        raise BackendError("SGLang wrote no tensor dump for a probed request (was the server started "
                           "with the probe's dump folder?)")
    token_kinds = [k for k in kinds if k != "logits"]
    parts: dict[str, list[torch.Tensor]] = {}
    logits: list[torch.Tensor] = []
    fed = 0
    for n, modules in enumerate(passes):
        for name, rows in pass_stages(modules, token_kinds).items():
            parts.setdefault(name, []).append(rows)
        fed += _rows(modules["model.embed_tokens"]).shape[0]
        after = passes[n + 1] if n + 1 < len(passes) else following
        if "logits" in kinds and fed >= prompt_len:  # a prefill chunk short of the prompt samples nothing
            logits.append(_rows(after["logits_processor"]))
    out = {name: torch.cat(rows) for name, rows in parts.items()}
    if "logits" in kinds:
        out["logits"] = torch.cat(logits)
        if response_len is not None and out["logits"].shape[0] != response_len:
            raise BackendError(f"SGLang dumped {out['logits'].shape[0]} logits rows for a response of "
                               f"{response_len} tokens: its passes do not map one to one onto the request's "
                               "tokens (was the server started with --disable-overlap-schedule?)")
        if bool((out["logits"] >= 0).all()) and torch.allclose(out["logits"].sum(-1).double(),
                                                                torch.ones(1, dtype=torch.float64)):
            raise UnsupportedError(SAMPLED_LOGITS)
    return out


def _response_len(result: Any) -> int | None:
    """The number of response tokens of a sample's result (a Rollout), if it has one."""
    tokens = getattr(result, "token_ids", None)
    return None if tokens is None else len(tokens)


def probe_samples(dumps: PassDumps, jobs: Sequence[Any], capture: Sequence[int], kinds: Sequence[str],
                  run_one: Callable[[int], Any], flush: Callable[[], None]) -> tuple[list[Any], dict]:
    """Run the jobs one at a time (`run_one(i)` -> that sample's result) and read the captured ones'
    stages: (results in job order, {job index: {stage: [rows, width]}}). `flush` runs one more
    request so the last pass's logits are written; each sample's files are removed once read."""
    results, spans = [], {}
    written = len(dumps.files())
    for i in range(len(jobs)):
        results.append(run_one(i))
        first, written = written, len(dumps.files())
        spans[i] = (first, written)
    flush()
    files = dumps.files()
    states = {}
    for i in capture:
        first, last = spans[i]
        passes = [torch.load(f, weights_only=True) for f in files[first:last]]
        following = torch.load(files[last], weights_only=True) if last < len(files) else {}
        if "logits" in kinds and "logits_processor" not in following:
            raise BackendError("SGLang did not write the last pass's logits (no pass after the probe's "
                               "last request)")
        states[i] = sample_stages(passes, following, len(jobs[i].request.prompt_ids), kinds,
                                  _response_len(results[i]))
    for f in files:
        f.unlink(missing_ok=True)
    return results, states
