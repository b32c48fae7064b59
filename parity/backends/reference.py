"""parity's own batch-invariant engine behind the backend contract: the zero-mismatch baseline.

The engine speaks parity's `Request`/`Rollout` natively; `score` is the training forward itself, so
with invariant kernels `score(rollouts)` equals the rollouts' logprobs bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from parity.backends.base import Backend
from parity.core.schema import VERSION
from parity.core.types import Pair, Request, Rollout, SamplingParams
from parity.engine import EngineConfig, ReferenceEngine, train_forward
from parity.engine.inputs import kernel_families
from parity.kernels import cpu_bf16
from parity.models.loading import tensor_digest
from parity.models.lora import LoraSpec


class ReferenceBackend(Backend):
    """`parity.engine.ReferenceEngine` for generate, `parity.engine.train_forward` for score; the
    options are `EngineConfig`'s fields but dtype (kernels "invariant": the baseline)."""

    name = "reference"
    native_turns = True  # the engine continues trajectories in place

    @classmethod
    def option_names(cls) -> list[str]:
        """The engine settings: `EngineConfig`'s fields but dtype."""
        return [f.name for f in dataclasses.fields(EngineConfig) if f.name != "dtype"]

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", **engine: Any) -> None:
        super().__init__(model, dtype=dtype)
        self.config = EngineConfig(dtype=dtype).replace(**engine)
        self.check_lora(self.config.lora)
        kernels, tp = self.config.kernels, self.config.tensor_parallel_size
        # bf16 tiles (AMX, AVX-512 BF16) and float32 tiles give different bits: the report says which
        # ran (a bad PARITY_CPU_BF16_GEMM is refused here, before the engine loads); only a bf16 model's
        # invariant products on the CPU run them
        on_cpu = torch.device(self.config.device).type == "cpu"
        gemm = cpu_bf16.choice() if on_cpu and "matmul" in kernel_families(kernels) else None
        self._engine = ReferenceEngine(self.model_path, self.config)
        # the ids the engine stops on, read with its model (a model `load_model` cached may predate an
        # edit of generation_config.json): one source, not a second read that could disagree with it
        self.eos_ids = self._engine.lm.eos_token_ids
        self.meta.update({
            "backend_version": VERSION, "torch_version": torch.__version__,
            "device": self.config.device, "attention_backend": f"parity ({kernels})",
            "batch_invariant": kernels == "invariant",
            "tensor_parallel_size": tp or 1,
            # the row-parallel K groups: TP runs give the same bits only for the same value
            "reduction_groups": None if tp is None else self.config.reduction_groups,
            "enable_prefix_caching": False, "kernels": kernels,
        })
        if gemm is not None and self.config.dtype == "bfloat16":
            self.meta["cpu_bf16_gemm"] = gemm

    def generate(self, requests: Sequence[Request]) -> list[Rollout]:
        return [dataclasses.replace(r, meta={**self.meta, **r.meta})
                for r in self._engine.generate(list(requests))]

    @classmethod
    def top_k_limit(cls, options: dict[str, Any]) -> int | None:
        return None  # the whole distribution is at hand

    def _score(self, pairs: list[Pair], sampling: SamplingParams) -> list[torch.Tensor]:
        """The training forward with this backend's dtype, device and kernels."""
        # with tensor parallelism this process holds the whole model on the CPU for input checks;
        # the training forward loads the canonical layout's shard itself (`EngineConfig.training`)
        model = self._engine.lm.path if self.config.tensor_parallel_size else self._engine.lm
        return train_forward(model, pairs, self.config.training(), logprobs_mode=sampling.logprobs_mode,
                             temperature=sampling.temperature, top_k=sampling.top_k,
                             top_p=sampling.top_p).logprobs

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """In place, by parameter name (`ReferenceEngine.update_weights`)."""
        self._engine.update_weights(named_tensors)

    def weight_checksums(self) -> dict[str, str | None]:
        return self._engine.weight_checksums()

    def expected_checksums(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
        """The tensors in the engine's dtype under their own names (the engine's layout is HF's)."""
        dtype = self._engine.lm.torch_dtype
        return {name: tensor_digest(tensor.to(dtype)) for name, tensor in named_tensors}

    def _load_adapter(self, spec: LoraSpec) -> None:
        """The new adapter's tensors written in place of the running one's."""
        self._engine.load_adapter(spec)

    def close(self) -> None:
        self._engine.close()
