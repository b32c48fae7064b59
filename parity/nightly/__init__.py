"""`parity nightly`: run a matrix of cases x backends x dtypes, keep the history in SQLite,
detect drift regressions with a statistical test, and write HTML/Markdown/JSON reports.
"""

from parity.nightly.command import main
from parity.nightly.runner import NightlyConfig, NightlyRun, run_nightly

__all__ = ["NightlyConfig", "NightlyRun", "main", "run_nightly"]
