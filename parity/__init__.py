"""parity: train/infer logprob parity for LLM reinforcement learning."""

# compare, score, report, tolerance and the advisor import NumPy only; torch and the engines load on first use
from parity.advisor import advise
from parity.audit import AuditResult, audit
from parity.compare import compare
from parity.core.errors import ParityError
from parity.core.moved import install as _serve_moved_paths
from parity.core.schema import VERSION as __version__
from parity.core.turns import Generate, Inject
from parity.core.types import Request, Rollout, SamplingParams
from parity.drift.tolerance import Tolerance
from parity.loop import loop
from parity.monitor import Monitor
from parity.report.document import ParityReport
from parity.runtime.quiet import follow_parent
from parity.scoring import score

# the modules users imported by path before the wings (parity.types, parity.cases, ...) keep working
_serve_moved_paths()

# an engine process re-imports the main module: if it imports parity, it is as quiet as its parent
follow_parent()

__all__ = ["AuditResult", "Generate", "Inject", "Monitor", "ParityError", "ParityReport", "Request",
           "Rollout", "SamplingParams", "Tolerance", "__version__", "advise", "audit", "compare", "loop",
           "score"]
