"""Faults a Ray worker injects into itself, for the Ray executor tests (`ROW_HOOK_ENV` names
`ray_faults:before_row`). PARITY_TEST_FAULTS holds JSON: {"kill": {row key: times}, "sleep":
{row key: seconds}, "counts": directory}. A worker about to run a "kill" row SIGKILLs its own
process the first `times` times (counted in files, since the process does not survive); a
"sleep" row waits first, so a test can interrupt the run while it is in flight."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

FAULTS_ENV = "PARITY_TEST_FAULTS"


def before_row(key: str) -> None:
    faults = json.loads(os.environ.get(FAULTS_ENV, "{}"))
    if key in faults.get("sleep", {}):
        time.sleep(faults["sleep"][key])
    if key in faults.get("kill", {}):
        counter = Path(faults["counts"]) / key.replace("|", "_")
        killed = int(counter.read_text()) if counter.exists() else 0
        if killed < faults["kill"][key]:
            counter.write_text(str(killed + 1))
            os.kill(os.getpid(), signal.SIGKILL)


def kills(counts: Path, key: str) -> int:
    """How many times workers killed themselves before row `key`."""
    counter = Path(counts) / key.replace("|", "_")
    return int(counter.read_text()) if counter.exists() else 0
