"""Tensor parallelism whose logprobs do not depend on the degree.

`shard_model` cuts a model into one rank's shard (column-parallel q/k/v/gate/up, vocabulary-
parallel embedding and head, expert-parallel experts, row-parallel o/down with the canonical
K-group sum); `RankGroup` runs the ranks; `Comm` is a rank's view. TP=1 (in-process), 2, 4, 8 and
the training forward give the same bits for one `reduction_groups`.
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
