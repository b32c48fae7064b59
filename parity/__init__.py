"""parity: train/infer logprob parity for LLM reinforcement learning."""

from parity.errors import ParityError
from parity.types import Request, Rollout, SamplingParams

__version__ = "0.1.0"

__all__ = ["ParityError", "Request", "Rollout", "SamplingParams", "__version__"]
