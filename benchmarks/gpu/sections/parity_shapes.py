"""The parity_shapes section: rollout == train_forward bit for bit on other families' shapes.

2-layer Llama-3.2-1B-, Qwen3-30B-A3B- and Qwen3-1.7B-shaped models with random weights (invariant,
and native as the negative control), through whatever matmul route this process proves.
"""

from __future__ import annotations

from benchmarks.gpu.records import failure
from benchmarks.gpu.results import Failure, ParityCheck, ParitySection
from benchmarks.gpu.run import Run
from benchmarks.gpu.sections.parity import parity_check
from parity.models import shaped

#: models of the parity_shapes section: (label, shape, layers, vocab).
PARITY_SHAPES = [("llama-3.2-1b-2l", "llama-3.2-1b", 2, 128256),
                 ("qwen3-30b-a3b-2l", "qwen3-30b-a3b", 2, 151936),
                 ("qwen3-1.7b-2l", "qwen3-1.7b", 2, 151936)]


def measure(run: Run) -> ParitySection:
    """See the module docstring."""
    checks: dict[str, ParityCheck | Failure] = {}
    for label, shape, layers, vocab in PARITY_SHAPES:
        config = shaped.shaped_config(shape, layers, vocab_size=vocab)
        path = shaped.save_random_model(config, run.tmp / label, device="cuda")
        for kernels in ("invariant", "native"):
            try:
                checks[f"{label}/{kernels}"] = parity_check(str(path), vocab, kernels)
            except Exception:
                checks[f"{label}/{kernels}"] = failure()
            run.checkpoint("parity_shapes", ParitySection(checks=dict(checks)))
    return ParitySection(checks=checks)
