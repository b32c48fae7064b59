"""The ParityReport document: the report itself (`document`: JSON, HTML, worst tokens), its decoded
text (`text`) and its provenance (`provenance`). `from parity.report import ParityReport` is the
public path."""

from parity.report.document import (
    ARRAY_FIELDS,
    CONTEXT_TOKENS,
    FORMAT,
    FORMAT_VERSION,
    GOLD_DTYPE,
    GOLD_FIELD,
    ParityReport,
    format_summary,
    format_worst_tokens,
)

__all__ = ["ARRAY_FIELDS", "CONTEXT_TOKENS", "FORMAT", "FORMAT_VERSION", "GOLD_DTYPE", "GOLD_FIELD",
           "ParityReport", "format_summary", "format_worst_tokens"]
