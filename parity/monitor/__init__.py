"""Train/rollout mismatch telemetry inside the user's own training run: `parity.Monitor` logs the
trainer's and the rollout's logprobs of every step (no forward) into an append-only SQLite store
and draws a page; `parity monitor OUT_DIR` reads a run, also one still going. Importing this
package never loads torch; the first `Monitor.log` does.
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
