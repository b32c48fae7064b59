"""parity: train/infer logprob parity for LLM reinforcement learning."""

# compare, score, report, tolerance and the advisor import NumPy only; torch and the engines load on first use
from parity.advisor import advise
from parity.audit import AuditResult, audit
from parity.compare import compare
from parity.errors import ParityError
from parity.loop import loop
from parity.monitor import Monitor
from parity.quiet import follow_parent
from parity.report import ParityReport
from parity.schema import VERSION as __version__
from parity.scoring import score
from parity.tolerance import Tolerance
from parity.turns import Generate, Inject
from parity.types import Request, Rollout, SamplingParams

# an engine process re-imports the main module: if it imports parity, it is as quiet as its parent
follow_parent()

__all__ = ["AuditResult", "Generate", "Inject", "Monitor", "ParityError", "ParityReport", "Request",
           "Rollout", "SamplingParams", "Tolerance", "__version__", "advise", "audit", "compare", "loop",
           "score"]
