"""The reference rollout engine and the training forward it is bitwise equal to.

    from parity.engine import ReferenceEngine, train_forward
    with ReferenceEngine("tiny-qwen3-moe", dtype="bfloat16", record_routes=True) as engine:
        rollouts = engine.generate(requests)
    logprobs = train_forward("tiny-qwen3-moe", rollouts, dtype="bfloat16").logprobs  # == rollouts', bitwise
"""

from parity.engine.engine import EngineConfig, ReferenceEngine
from parity.engine.train import LAYOUTS, TrainConfig, TrainResult, train_forward

__all__ = ["LAYOUTS", "EngineConfig", "ReferenceEngine", "TrainConfig", "TrainResult", "train_forward"]
