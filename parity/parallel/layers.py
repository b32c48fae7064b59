"""Tensor-parallel layers whose results do not depend on the tensor-parallel degree.

Column-parallel projections need no new layer (each output column is one weight row times the
whole input). A row-parallel all-reduce makes the bits a function of degree and algorithm, so
`RowParallelLinear` cuts K into `groups` slices (`reduction_groups`, not the degree), computes
each with the invariant matmul, widens them to fp32 and adds them by one fixed tree of adjacent
pairs (`block_tree_sum`), at TP=1 too. A rank holding a power of two of the (contiguous) groups
holds a whole subtree: it adds them itself and all-gathers one fp32 partial (a copy) for the rest
of the tree; otherwise every group's partial is gathered. Bits match across degrees for one
`groups` only; every degree must divide it, and fewer groups cost less.
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
    """x [..., K / size] (this rank's K slice) -> [..., N], the same on every rank; weight kept as its
    `groups / size` contiguous [N, K / groups] groups, bias added once to the fp32 sum.
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
    """Token ids [...] -> embeddings [..., H] from this rank's vocabulary rows, all-gathered and each
    token taking its owner's row: bit for bit the unsharded lookup.
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
    """This rank's experts [start, start + count) of an MoE layer: hidden [N, H], top_k_* [N, k] ->
    [N, H]. Each slot's row comes from its owner by all-gather and a token's k slots are added in
    order, at every degree, 1 included.
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
