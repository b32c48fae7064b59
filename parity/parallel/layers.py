"""Tensor-parallel layers whose results do not depend on the tensor-parallel degree.

Column-parallel projections (q/k/v/gate/up) need no new layer: each output column is one row of
the weight times the full input, so a rank's slice of the weight computes exactly the columns
the unsharded layer would (the matmul kernels fix their K order per weight row, not per N).

A row-parallel projection (o/down) splits its K reduction across ranks. Summing the ranks'
partial products with an all-reduce makes the order of additions, and so the bits, a function of
the TP degree and of the collective's algorithm. `RowParallelLinear` instead fixes the sum: K is
cut into `groups` equal slices (a setting, `reduction_groups`, not the TP degree), each slice's
product is computed on its own by the batch-invariant matmul and widened to fp32, and the groups
are added by one fixed tree of adjacent pairs in fp32 (`block_tree_sum`). A rank holds contiguous
groups, so when it holds a power of two of them their subtree is whole on the rank: it adds them
itself and only that one fp32 partial per rank is all-gathered (an exact copy, not a sum) for the
rest of the tree; otherwise every group's partial is gathered. At TP=1 the same groups and the same
tree run in one process, so TP=1, 2, 4 and 8 give the same bits, for the same `groups`: a different
group count is a different sum, so bits are equal across degrees only between runs with the same
`reduction_groups`. In bf16 each
group's product is rounded to bf16 by the matmul before it is widened (the matmul kernels write
the model dtype): deterministic, and `groups` roundings of partial sums where the whole-model
layer has one.

The trade: every degree must divide `groups` (the largest degree is `groups`), and each group is
its own matmul plus an fp32 partial [tokens, N], so fewer groups cost less (fewer, larger matmuls;
fewer adds) and allow fewer degrees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parity.core.errors import ConfigError
from parity.core.schema import REDUCTION_GROUPS
from parity.kernels import ops
from parity.parallel.comm import Comm

#: how a row-parallel layer combines partial products: the fixed tree, or a stock all-reduce (contrast).
REDUCTIONS: tuple[str, ...] = ("canonical", "all_reduce")


def block_tree_sum(x: torch.Tensor) -> torch.Tensor:
    """x [n, ...] summed over dim 0 by a fixed tree of adjacent pairs ((0+1)+(2+3))+...: zeros pad n
    to a power of two (x + 0 == x exactly). Any aligned block of a power-of-two size is a subtree, so
    summing blocks first and then their sums gives the same bits."""
    n = x.shape[0]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.cat([x, x.new_zeros(width - n, *x.shape[1:])])
    while x.shape[0] > 1:
        x = x[0::2] + x[1::2]
    return x[0]


class RowParallelLinear(nn.Module):
    """x [..., K / size] (this rank's K slice) -> [..., N], the same on every rank.

    weight: this rank's [N, K / size] slice; its `groups / size` K groups are kept as separate
    contiguous [N, K / groups] tensors (the CUDA matmul reads whole rows). bias [N] or None is
    added once to the fp32 sum. groups: the K groups of the whole layer (`reduction_groups`; the
    degree divides it); the bits depend on it, not on the degree.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm,
                 groups: int = REDUCTION_GROUPS, reduction: str = "canonical") -> None:
        super().__init__()
        if groups % comm.size:
            raise ConfigError(f"reduction_groups={groups} is not divisible by tensor_parallel_size="
                              f"{comm.size}; choose reduction_groups a multiple of the degree")
        local = groups // comm.size
        self.comm, self.reduction, self.in_features = comm, reduction, weight.shape[1]
        # the contrast multiplies the whole slice at once; the canonical sum keeps only the groups
        stock = reduction == "all_reduce"
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False) if stock else None
        self.parts = nn.ParameterList(() if reduction == "all_reduce" else
                                      (nn.Parameter(w.contiguous(), requires_grad=False)
                                       for w in weight.chunk(local, dim=1)))
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduction == "all_reduce":
            out = self.comm.all_reduce(ops.linear(x, self.weight))
            return out if self.bias is None else out + self.bias
        width = self.parts[0].shape[1]
        partials = torch.stack([ops.linear(x[..., g * width:(g + 1) * width], w).to(torch.float32)
                                for g, w in enumerate(self.parts)])  # [groups / size, ..., N]
        local = len(self.parts)
        if local & (local - 1) == 0:
            # this rank's groups are one whole subtree of the global tree: add them here, gather one
            # partial per rank, and finish the same tree over the ranks (zero padding included)
            total = block_tree_sum(self.comm.all_gather(block_tree_sum(partials)))
        else:
            total = block_tree_sum(self.comm.all_gather(partials).flatten(0, 1))
        if self.bias is not None:
            total = total + self.bias.to(torch.float32)
        return total.to(x.dtype)


class VocabParallelEmbedding(nn.Module):
    """Token ids [...] -> embeddings [..., H]; this rank holds vocabulary rows [start, start + rows).

    Each rank looks up the ids it owns (zeros elsewhere); the rows are all-gathered and every
    token takes its owner's row: a copy, so the result is the unsharded lookup bit for bit.
    """

    def __init__(self, weight: torch.Tensor, start: int, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.start
        mine = (local >= 0) & (local < rows)
        found = F.embedding(local.clamp(0, rows - 1), self.weight)
        found = torch.where(mine.unsqueeze(-1), found, torch.zeros_like(found))
        gathered = self.comm.all_gather(found)  # [size, ..., H]
        owner = (ids // rows).unsqueeze(0).unsqueeze(-1)
        return torch.take_along_dim(gathered, owner, dim=0).squeeze(0)


class VocabParallelHead(nn.Module):
    """Hidden [N, H] -> logits [N, vocab]: this rank's vocabulary slice [rows, H] (zero rows pad the
    last slice), all-gathered into the full vocabulary before any log-softmax sees it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, vocab: int, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
        self.vocab, self.comm = vocab, comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = ops.linear(hidden, self.weight, self.bias)  # [..., rows]
        gathered = self.comm.all_gather(local)  # [size, ..., rows]
        return gathered.movedim(0, -2).flatten(-2)[..., :self.vocab]


class ExpertParallelExperts(nn.Module):
    """Experts [start, start + count) of an MoE layer on this rank (expert parallelism).

    Called like HF's experts module: hidden [N, H], top_k_index, top_k_weights [N, k] -> [N, H].
    Each rank computes the weighted output of the (token, slot) rows routed to its experts with
    the layer's own (invariant) expert kernel, one row per slot; the rows are all-gathered, each
    slot takes its owner's row (a copy), and the k slots of a token are added in slot order.
    Every degree, 1 included, runs this same decomposition, so the result does not depend on it.
    """

    def __init__(self, local: nn.Module, start: int, count: int, comm: Comm) -> None:
        super().__init__()
        self.local, self.start, self.count, self.comm = local, start, count, comm

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        n, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        owner = flat // self.count
        rows = hidden.new_zeros(n * k, hidden.shape[-1])
        mine = (owner == self.comm.rank).nonzero().squeeze(1)
        if mine.numel():
            rows[mine] = self.local(hidden[mine // k], (flat[mine] - self.start).unsqueeze(1),
                                    top_k_weights.reshape(-1)[mine].unsqueeze(1))
        gathered = self.comm.all_gather(rows)  # [size, N * k, H]
        slots = torch.take_along_dim(gathered, owner.view(1, -1, 1), dim=0).view(n, k, -1)
        combined = slots[:, 0]
        for j in range(1, k):
            combined = combined + slots[:, j]
        return combined
