"""The reference rollout engine and the training forward it is bitwise equal to
(`train_forward(model, engine.generate(requests)).logprobs` equals the rollouts' logprobs).
"""

from parity.engine.engine import EngineConfig, ReferenceEngine
from parity.engine.train import LAYOUTS, TrainConfig, TrainResult, train_forward

__all__ = ["LAYOUTS", "EngineConfig", "ReferenceEngine", "TrainConfig", "TrainResult", "train_forward"]
