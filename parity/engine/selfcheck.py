"""The engine's own exactness check over the sampling grid: rollouts vs the training forward.

Samples every (temperature, top_p, top_k) setting of a grid in one engine run and counts, per
setting, the tokens whose logprobs differ in any bit from `train_forward`; with invariant kernels
every count is 0 on every device.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from parity.core.errors import ConfigError
from parity.core.types import Request, SamplingParams
from parity.engine.engine import ReferenceEngine
from parity.engine.inputs import KernelMode, check_positive_int
from parity.engine.train import train_forward
from parity.models.loading import LoadedModel, load_model

#: (temperature, top_p, top_k): the grid every parity check covers.
SAMPLING_GRID: tuple[tuple[float, float, int], ...] = tuple(
    (t, p, k) for t in (0.6, 1.0, 1.2) for p in (1.0, 0.9) for k in (0, 40))


@dataclass(frozen=True)
class SettingCheck:
    """One grid setting's result: `differing` of `tokens` response tokens have logprobs that are
    not bitwise equal between rollout and training forward; `max_abs_diff` in nats."""

    temperature: float
    top_p: float
    top_k: int
    tokens: int
    differing: int
    max_abs_diff: float


def sampling_grid_check(model: str | LoadedModel, *, device: str = "cpu", dtype: str = "bfloat16",
                        kernels: KernelMode = "invariant",
                        grid: Sequence[tuple[float, float, int]] = SAMPLING_GRID,
                        requests: int = 24, n: int = 2, prompt_len: int = 16, max_tokens: int = 24,
                        max_num_seqs: int = 8, chunk_size: int = 32, layout: str = "right",
                        micro_batch_size: int | None = None, seed: int = 0) -> list[SettingCheck]:
    """Per grid setting, the rollout tokens that differ from `train_forward` (EOS ignored)."""
    check_positive_int(requests, "requests")  # 0 would check no token and read as 0 differing
    if not grid:
        raise ConfigError("sampling_grid_check: grid is empty, so nothing would be checked; give at least "
                          "one (temperature, top_p, top_k) setting or leave the default SAMPLING_GRID")
    lm = load_model(model, dtype=dtype, device=device)
    rng = random.Random(seed)
    work = [Request(tuple(rng.randrange(3, lm.vocab_size) for _ in range(prompt_len)),
                    SamplingParams(n=n, temperature=t, top_p=p, top_k=k, max_tokens=max_tokens,
                                   seed=rng.randrange(2**31), ignore_eos=True),
                    request_id=f"{g}/{i}")
            for g, (t, p, k) in enumerate(grid) for i in range(requests)]
    with ReferenceEngine(lm, dtype=dtype, device=device, kernels=kernels, max_num_seqs=max_num_seqs,
                         chunk_size=chunk_size) as engine:
        rollouts = engine.generate(work)
    setting = {r.request_id: int(r.request_id.split("/")[0]) for r in work}
    # each rollout is scored under the sampling it records (its grid setting)
    scores = train_forward(lm, rollouts, dtype=dtype, device=device, kernels=kernels, layout=layout,
                           micro_batch_size=micro_batch_size).logprobs
    tallies = [[0, 0, 0.0] for _ in grid]
    for rollout, score in zip(rollouts, scores):
        rolled = torch.tensor(rollout.logprobs, dtype=torch.float32)
        trained = score.cpu()
        tally = tallies[setting[rollout.request_id]]
        tally[0] += len(rolled)
        tally[1] += int((rolled.view(torch.int32) != trained.view(torch.int32)).sum())
        finite = torch.isfinite(rolled) & torch.isfinite(trained)
        if finite.any():
            tally[2] = max(tally[2], float((rolled[finite] - trained[finite]).abs().max()))
    return [SettingCheck(t, p, k, tokens, differing, diff)
            for (t, p, k), (tokens, differing, diff) in zip(grid, tallies)]
