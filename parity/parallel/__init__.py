"""Tensor parallelism whose logprobs do not depend on the degree.

`shard_model` cuts a loaded model into one rank's shard (column-parallel q/k/v/gate/up,
vocabulary-parallel embedding and LM head, expert-parallel MoE experts, and row-parallel o/down
with the canonical K-group reduction of `layers.RowParallelLinear`, in `reduction_groups` groups);
`RankGroup` launches and stops the rank processes; `Comm` is a rank's view of the group. The
engine and the training forward take `tensor_parallel_size=k` and use these; at k = 1 the same
sharded layout runs in-process, so TP=1, 2, 4, 8 and the training forward give the same bits
(for one `reduction_groups`: each value is its own sum).
"""

from parity.parallel.comm import Comm
from parity.parallel.group import RankGroup, TensorParallelError
from parity.parallel.layers import REDUCTION_GROUPS, REDUCTIONS
from parity.parallel.shard import (
    TP_DEGREES,
    check_degree,
    check_reduction_groups,
    check_shardable,
    shard_model,
)

__all__ = ["REDUCTIONS", "REDUCTION_GROUPS", "TP_DEGREES", "Comm", "RankGroup", "TensorParallelError",
           "check_degree", "check_reduction_groups", "check_shardable", "shard_model"]
