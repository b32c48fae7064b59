"""The loop's record: one row per step and backend, one update per step, as JSON (no torch).

    {"model", "backends", "seed",
     "steps": [{"step", "backend", "max_abs_logprob_diff", "mean_abs_logprob_diff", "k3_kl",
                "is_ratio_mean", "reward_mean", "policy_kl_from_start", "weights_in_sync",
                "seconds", ...more: STEP_EXTRA_KEYS}],
     "updates": [{"step", "loss", "grad_norm", "forward_bitwise", "kept_tokens", "seconds",
                  with lora_rank: "adapter_hash", "adapter_bytes"}],
     "train_on", "config", "provenance", "status", "error"}

Row `(t, b)` is backend b at the weights W_t (before step t's update); its seconds are b's
sampling, scoring and the push of W_t. `status`: "running", "complete", "diverged", "failed" or
"interrupted", `error` naming the step; rewritten atomically each step. Same seed and config give
the same JSON but for `TIMING_KEYS` (`without_timing`). A non-finite float of a row is null, with the
row's "nonfinite" entry naming it ({"k3_kl": "inf"}; `parity.core.tables.nonfinite_as_null`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.core.errors import InputError
from parity.core.outputs import write_atomic
from parity.core.tables import nonfinite_as_null, nonfinite_restored

#: the keys of a step row the JSON contract names (issue 36), in order.
STEP_KEYS: tuple[str, ...] = ("step", "backend", "max_abs_logprob_diff", "mean_abs_logprob_diff", "k3_kl",
                              "is_ratio_mean", "reward_mean", "policy_kl_from_start", "weights_in_sync",
                              "seconds")
#: more per-row keys: the IS ratio's extremes, PPO's clip fraction on this backend's logprobs, the
#: share of tokens whose ratio or its inverse exceeds 2 (a tolerance limit), whether every rollout
#: logprob equals the training forward's bit for bit, the tokens compared,
#: whether this backend's rollouts trained the policy, how many weight tensors the backend could
#: not show to the sync check (`parity.loop.sync`), and what a failed sync check found.
STEP_EXTRA_KEYS: tuple[str, ...] = ("is_ratio_min", "is_ratio_max", "clip_fraction", "frac_tokens_ratio_gt_2",
                                    "bitwise", "num_tokens", "trained_on", "sync_hidden", "sync_detail")
UPDATE_KEYS: tuple[str, ...] = ("step", "loss", "grad_norm", "forward_bitwise", "kept_tokens", "seconds")
#: more update keys of an adapter-only run (`lora_rank`): the content hash (`LoraSpec.hash`) and
#: the bytes of the adapter the update wrote, which the next step's push sends (the last step's
#: is written, not pushed).
ADAPTER_UPDATE_KEYS: tuple[str, ...] = ("adapter_hash", "adapter_bytes")
#: fields that differ between identical runs (wall-clock time); dropped by `without_timing`.
TIMING_KEYS: tuple[str, ...] = ("seconds",)
STATUSES: tuple[str, ...] = ("running", "complete", "diverged", "failed", "interrupted")


@dataclass
class LoopRecord:
    """The loop's results so far; `steps` and `updates` grow as the loop runs."""

    model: str
    backends: list[str]
    seed: int
    train_on: str
    config: dict[str, Any]
    provenance: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    status: str = "running"
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "backends": list(self.backends), "seed": self.seed,
                "steps": [nonfinite_as_null(row) for row in self.steps],
                "updates": [nonfinite_as_null(u) for u in self.updates],
                "train_on": self.train_on, "config": self.config, "provenance": self.provenance,
                "status": self.status, "error": self.error}

    def to_json(self) -> str:
        # default=str: a backend option the caller gave as an object is recorded by its text
        return json.dumps(self.to_dict(), indent=1, default=str) + "\n"

    def write(self, path: Path) -> None:
        """Write the JSON to `path` atomically (a reader sees the previous or the new file, whole)."""
        write_atomic(path, self.to_json())

    @classmethod
    def from_dict(cls, d: Any) -> LoopRecord:
        if not isinstance(d, dict):
            raise InputError(f"a loop record must be a JSON object, got {type(d).__name__}")
        missing = [k for k in ("model", "backends", "seed", "steps") if k not in d]
        if missing:
            raise InputError(f"loop record: missing field {missing[0]!r}")
        steps, updates = (_rows(d.get(name, []), name) for name in ("steps", "updates"))
        return cls(model=d["model"], backends=list(d["backends"]), seed=d["seed"],
                   train_on=d.get("train_on", ""), config=d.get("config", {}),
                   provenance=d.get("provenance", {}), steps=steps,
                   updates=updates, status=d.get("status", "complete"),
                   error=d.get("error"))

    @classmethod
    def read(cls, path: str | Path) -> LoopRecord:
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"{path}: not a readable loop record ({exc})") from exc

    def rows(self, backend: str) -> list[dict[str, Any]]:
        """The step rows of one backend, in step order."""
        return [row for row in self.steps if row["backend"] == backend]


def without_timing(document: Any) -> Any:
    """A JSON value with every `TIMING_KEYS` entry removed, at any depth."""
    if isinstance(document, dict):
        return {k: without_timing(v) for k, v in document.items() if k not in TIMING_KEYS}
    if isinstance(document, list):
        return [without_timing(v) for v in document]
    return document


def _rows(rows: Any, name: str) -> list[dict[str, Any]]:
    """A record's step or update rows with their non-finite floats back (`nonfinite_restored`)."""
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise InputError(f"loop record: {name!r} must be a list of objects")
    return [nonfinite_restored(row, f"loop record: {name}[{i}]") for i, row in enumerate(rows)]
