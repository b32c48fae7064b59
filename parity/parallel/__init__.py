"""Tensor parallelism whose logprobs do not depend on the degree.

`shard_model` cuts a model into one rank's shard (column-parallel q/k/v/gate/up, vocabulary-
parallel embedding and head, expert-parallel experts, row-parallel o/down with the canonical
K-group sum); `RankGroup` runs the ranks; `Comm` is a rank's view. TP=1 (in-process), 2, 4, 8 and
the training forward give the same bits for one `reduction_groups`.

The names load their module on first use: a rank process (`python -m parity.parallel.rank`) imports
this package before anything else, and `shard` loads transformers (~6 CPU-s) that a rank whose object
shards no model never needs; torch.distributed also loads only after the rank's loopback settings.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: exported name -> the module of this package that defines it.
_HOMES = {
    "Comm": "comm", "RankGroup": "group", "TensorParallelError": "group", "REDUCTION_GROUPS": "layers",
    "REDUCTIONS": "layers", "TP_DEGREES": "shard", "check_degree": "shard", "check_reduction_groups": "shard",
    "check_shardable": "shard", "shard_model": "shard",
}

__all__ = ["REDUCTIONS", "REDUCTION_GROUPS", "TP_DEGREES", "Comm", "RankGroup", "TensorParallelError",
           "check_degree", "check_reduction_groups", "check_shardable", "shard_model"]


def __getattr__(name: str) -> Any:
    """`parity.parallel.NAME`: imported from its module when first asked for (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'parity.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"parity.parallel.{_HOMES[name]}"), name)
