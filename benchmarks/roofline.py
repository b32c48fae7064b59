"""A lower bound on the time of a generate workload, from the model's shapes alone.

No engine can beat it on the measured machine: prefill is at least its matmul FLOPs at the
measured matmul peak, and each decode step at least max(bytes it must read / measured copy
bandwidth, its FLOPs / peak), where the bytes are every weight a step touches once (at batch
B and top-k of E experts, the expected number of distinct experts hit) plus each sequence's KV
cache up to its current length. Embedding rows, activations, sampling and launch gaps are left
out, so the bound is optimistic and "fraction of bound" is a fair score.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the bound needs of a decoder: parameter counts and attention sizes (bf16: 2 bytes each).

    dense_params: weights every token uses (attention, norms, dense MLPs, router, lm_head; not the
    input embedding); expert_params: all routed experts' weights (0 for a dense model);
    experts, top_k: routed experts per MoE layer and experts per token.
    """

    dense_params: int
    expert_params: int
    experts: int
    top_k: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2

    def __post_init__(self) -> None:
        if self.expert_params and not 0 < self.top_k <= self.experts:
            raise ValueError(f"ModelShape: top_k={self.top_k} must be in 1..experts={self.experts}")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    def active_params(self) -> float:
        """Weights one token multiplies with."""
        share = self.top_k / self.experts if self.experts else 0.0
        return self.dense_params + self.expert_params * share

    def touched_params(self, batch: int) -> float:
        """Expected weights a step of `batch` tokens reads (experts hit by at least one token)."""
        if not self.experts:
            return float(self.dense_params)
        hit = 1.0 - (1.0 - self.top_k / self.experts) ** batch
        return self.dense_params + self.expert_params * hit


@dataclass(frozen=True)
class Bound:
    """Lower-bound seconds: prefill, decode (sum over steps), total; and the output tokens it produces."""

    prefill_s: float
    decode_s: float
    seconds: float
    output_tokens: int
    output_tok_s: float


def bound(shape: ModelShape, requests: int, prompt: int, output: int, *, bandwidth: float,
          flops: float) -> Bound:
    """The workload's bound: `requests` sequences of `prompt` tokens generating `output` each, on a
    machine of `bandwidth` bytes/s (measured copy) and `flops` FLOP/s (measured matmul peak)."""
    attn_flops_per_key = 4 * shape.layers * shape.q_heads * shape.head_dim  # QK^T and PV, per query-key
    prefill_flops = requests * (2 * shape.active_params() * prompt
                                + attn_flops_per_key * prompt * (prompt + 1) / 2)
    prefill_s = prefill_flops / flops
    decode_s = 0.0
    weight_bytes = shape.touched_params(requests) * shape.bytes_per_param
    for step in range(1, output):  # the first output token comes from prefill's logits
        context = prompt + step
        read = weight_bytes + requests * context * shape.kv_bytes_per_token
        work = requests * (2 * shape.active_params() + attn_flops_per_key * context)
        decode_s += max(read / bandwidth, work / flops)
    total = prefill_s + decode_s
    tokens = requests * output
    return Bound(prefill_s=prefill_s, decode_s=decode_s, seconds=total, output_tokens=tokens,
                 output_tok_s=tokens / total)
