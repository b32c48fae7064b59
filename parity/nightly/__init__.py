"""`parity nightly`: run a matrix of cases x backends x dtypes, keep the history in SQLite,
detect drift regressions with a statistical test, and write HTML/Markdown/JSON reports.

Modules, one job each: `runner` (the matrix; judges and stores rows), `execute` (one row, in
whatever process runs it), `ray_executor` (rows on a Ray cluster), `history` (SQLite store),
`regression` (the test), `rows` (row keys, statuses, exit code), `environment` (provenance of the
run), `charts`, `html_report`, `markdown_report` and `publish` (the report directory), `command`
(the CLI).
"""

from parity.nightly.command import main
from parity.nightly.runner import NightlyConfig, NightlyRun, run_nightly

__all__ = ["NightlyConfig", "NightlyRun", "main", "run_nightly"]
