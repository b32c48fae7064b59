"""Is this engine deterministic and batch-invariant? An audit of any backend.

`parity.audit(model, backend)` samples one case's seeded requests in pairs of situations and
compares the bits (`parity.audit.checks`): `repeat` (the same batch twice), `batch` (a needle
alone and inside batches of other-length neighbours), `order` (the batch shuffled),
`prefill_decode` (sampled logprobs against the backend's own scoring of the same tokens),
`prefix_cache` (cache off and on) and `seed` (the control: other seeds, other samples). The result
(`AuditResult`, stable JSON) says whether the backend is `deterministic` and `batch_invariant`;
`parity audit` is the command (`parity.audit.command`), and nightly runs cases of kind "audit".
"""

from parity.audit.result import CHECKS, AuditResult, CheckResult
from parity.audit.run import audit

__all__ = ["CHECKS", "AuditResult", "CheckResult", "audit"]
