"""Is this engine deterministic and batch-invariant? An audit of any backend.

`parity.audit(model, backend)` samples one case's seeded requests in pairs of situations and
compares the bits: repeat, batch, order, prefill_decode, prefix_cache and seed (the control).
`AuditResult` says whether it is `deterministic` and `batch_invariant`; `parity audit` is the command.
"""

from parity.audit.result import CHECKS, AuditResult, CheckResult
from parity.audit.run import audit

__all__ = ["CHECKS", "AuditResult", "CheckResult", "audit"]
