"""Where the monitor's background work runs, off the training thread: the advisor in a thread (NumPy
releases the GIL), the page in a child process (matplotlib would hold the GIL, docs/PERF.md
"Monitor"), or in a thread with `Background("thread")`. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from parity.advisor import advise
from parity.core.errors import ConfigError

#: where the page is drawn: a child process, or a thread of the training process.
MODES = ("process", "thread")


def advice_job(train: Any, rollout: Any, mask: Any, policy_lag: int | None, bootstrap: int) -> dict[str, Any]:
    """The advisor's recommendation of one step's `[batch, seq]` arrays."""
    return advise(train, rollout, mask, bootstrap=bootstrap, seed=0, policy_lag=policy_lag).to_dict()[
        "recommendation"]


class Background:
    """One worker thread that runs submitted jobs in order; `mode` says where the page is drawn."""

    def __init__(self, mode: str = "process") -> None:
        if mode not in MODES:
            raise ConfigError(f"background must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, job: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="parity-monitor")
        return self._executor.submit(job, *args, **kwargs)

    def close(self) -> None:
        """Wait for the submitted jobs and stop the worker."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
