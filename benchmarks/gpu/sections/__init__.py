"""One module per section of the GPU script; each has `measure(run)`, which returns its typed result."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.gpu.run import Run
from benchmarks.gpu.sections import (
    attention_sweep,
    cublaslt,
    e2e,
    kernels,
    moe_e2e,
    parity,
    parity_shapes,
    probe,
    probed,
    profile,
    roofline,
    step_split,
    tp,
    tp_sim,
)

#: Every section, by the name `--sections` takes, in the default order.
SECTIONS: dict[str, Callable[[Run], Any]] = {
    "kernels": kernels.measure,
    "parity": parity.measure,
    "e2e": e2e.measure,
    "profile": profile.measure,
    "step_split": step_split.measure,
    "cublaslt": cublaslt.measure,
    "probe": probe.measure,
    "attention_sweep": attention_sweep.measure,
    "parity_shapes": parity_shapes.measure,
    "moe_e2e": moe_e2e.measure,
    "probed": probed.measure,
    "roofline": roofline.measure,
    "tp": tp.measure,
    "tp_sim": tp_sim.measure,
}
