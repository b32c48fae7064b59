"""Train/rollout mismatch telemetry inside the user's own training run: `parity.Monitor` logs the
trainer's and the rollout's logprobs of every step (no forward) into an append-only SQLite store
and draws a page; `parity monitor OUT_DIR` reads a run, also one still going.

Modules: `core` (`Monitor`: checks, the step's record, thresholds, resume, policy versions, the
store, the background work), `summary` (one step's record from parity's metrics, correction and
advisor; torch), `thresholds` (absolute and relative alert bounds), `store` (the SQLite file:
attempts, journal, writer lock), `page` (the HTML page, drawn off the critical path), `background`
(where the advisor and the page run), `arrays` (tensors and arrays as NumPy, duck-typed),
`top_k` (full-distribution drift from the rollout's top-k), `train_view` (`train_top_k`, the
trainer's side of it; torch), `command` (`parity monitor`). Importing this package never loads
torch; the first `Monitor.log` does.
"""

from typing import Any

from parity.monitor.core import Monitor
from parity.monitor.page import flat_values, write_page
from parity.monitor.store import MonitorStore

__all__ = ["Monitor", "MonitorStore", "flat_values", "train_top_k", "write_page"]


def __getattr__(name: str) -> Any:
    """`train_top_k` on first use (it loads torch)."""
    if name == "train_top_k":
        from parity.monitor.train_view import train_top_k  # loads torch: only when asked for

        return train_top_k
    raise AttributeError(f"module 'parity.monitor' has no attribute {name!r}")
