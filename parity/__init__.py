"""parity: train/infer logprob parity for LLM reinforcement learning."""

# compare, report and tolerance import NumPy only; torch and the engines load on first use
from parity.compare import compare
from parity.errors import ParityError
from parity.report import ParityReport
from parity.schema import VERSION as __version__
from parity.tolerance import Tolerance
from parity.types import Request, Rollout, SamplingParams

__all__ = ["ParityError", "ParityReport", "Request", "Rollout", "SamplingParams", "Tolerance", "__version__",
           "compare"]
