"""Cases: a model, a prompt workload, sampling, dtypes, backends and a tolerance, in one object.

A case file (TOML, in `cases/`) is loaded by `load_case`; `default_case` is the built-in workload
used when `parity.compare` gets neither prompts nor a case.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parity.tolerance import Tolerance
from parity.types import LogprobsMode, Request, SamplingParams


@dataclass(frozen=True)
class Case:
    """One parity workload.

    requests: the prompts with their sampling parameters (seeds included), in send order.
    dtypes: dtypes to run ("bfloat16", "float16", "float32"); `compare` uses the first.
    backends: backend names the case is meant for (nightly's matrix); empty = any.
    tolerance: limits for pass/fail; None = the backend's default.
    """

    name: str
    model: str
    requests: tuple[Request, ...]
    dtypes: tuple[str, ...] = ("bfloat16",)
    backends: tuple[str, ...] = ()
    logprobs_mode: LogprobsMode = "processed"
    tolerance: Tolerance | None = None
    path: Path | None = None

    @property
    def hash(self) -> str:
        """sha256 of everything that defines the workload (provenance; 16 hex digits)."""
        body = {
            "model": self.model, "dtypes": list(self.dtypes), "logprobs_mode": self.logprobs_mode,
            "requests": [r.to_dict() for r in self.requests],
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def default_case(model: str = "tiny-llama", *, num_prompts: int = 8, max_tokens: int = 32,
                 seed: int = 0) -> Case:
    """The built-in workload: `num_prompts` random byte-token prompts of 8-48 tokens, n=2,
    temperature 1.0, top-p 0.95, seeds 1000+i."""
    rng = np.random.Generator(np.random.PCG64(seed))
    sampling = SamplingParams(n=2, temperature=1.0, top_p=0.95, max_tokens=max_tokens)
    requests = []
    for i in range(num_prompts):
        length = int(rng.integers(8, 49))
        ids = tuple(int(t) for t in rng.integers(3, 259, size=length))
        requests.append(Request(ids, sampling.replace(seed=1000 + i), request_id=f"default-{i}"))
    return Case(name="default", model=model, requests=tuple(requests))
