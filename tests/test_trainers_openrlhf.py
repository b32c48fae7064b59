"""OpenRLHF for real: `Experience` batches made as openrlhf 0.11's samples generator makes them
(one per vLLM response: whole sequence, `action_mask = mask[1:]`, `rollout_log_probs[1:]`) and
merged by its own `Experience.concat_experiences` (right-padded, as the experience maker batches
them), read by `parity.integrations.openrlhf`.

The rollouts are parity's reference engine's (float32), so the dump scored with the training forward
is exact (0) only when prompts, the one-position shift and the padding all came through right; the
negative control reads the same batch with the shift left out. Skips without openrlhf (installed with
`--no-deps`: its wheel pins deepspeed, flash-attn and transformers==5.15; the experience module needs
torch and pylatexenc)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import parity
from parity.backends import shared_backend
from parity.cli import main
from parity.core.errors import InputError
from parity.core.types import Request, SamplingParams
from parity.integrations import openrlhf as parity_openrlhf
from parity.report.document import ParityReport

experience = pytest.importorskip("openrlhf.trainer.ppo_utils.experience",
                                 reason="openrlhf is not installed (pip install --no-deps openrlhf)")
pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
TEMPERATURE = 0.7
PAD = 3  # a real token id: the reader must go by attention_mask, not by the pad id


@pytest.fixture(scope="module")
def rollouts():
    engine = shared_backend("reference", "tiny-llama", dtype="float32")
    requests = [Request(prompt_ids=tuple(range(5, 5 + n)), request_id=f"q{i}",
                        sampling=SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=6 + 3 * i,
                                                seed=11 + i))
                for i, n in enumerate((3, 9, 5))]
    return sorted(engine.generate(requests), key=lambda r: r.key)


def trainer_logprobs(r) -> np.ndarray:
    rng = np.random.default_rng(len(r.token_ids) + r.sample_index)
    return np.minimum(np.asarray(r.logprobs) + rng.normal(0.0, 0.05, len(r.logprobs)), 0.0)


def one_experience(r) -> experience.Experience:
    """As `_process_response_into_experience` builds it, with the actor's `action_log_probs` set as the
    experience maker sets them (same shift)."""
    seq = list(r.prompt_ids) + list(r.token_ids)
    p = len(r.prompt_ids)
    mask = torch.zeros(len(seq), dtype=torch.long)
    mask[p:] = 1
    per_token = torch.zeros(len(seq))
    per_token[p:] = torch.tensor(r.logprobs)
    actor = torch.zeros(len(seq))
    actor[p:] = torch.from_numpy(trainer_logprobs(r)).float()
    return experience.Experience(
        sequences=torch.tensor(seq).unsqueeze(0), attention_mask=torch.ones(1, len(seq), dtype=torch.long),
        action_mask=mask[1:].unsqueeze(0), rollout_log_probs=per_token[1:].unsqueeze(0),
        action_log_probs=actor[1:].unsqueeze(0), response_length=torch.tensor([len(r.token_ids)]),
        prompts=[r.request_id])


@pytest.fixture(scope="module")
def batch(rollouts) -> experience.Experience:
    return experience.Experience.concat_experiences([one_experience(r) for r in rollouts], pad_token_id=PAD)


def test_an_openrlhf_experience_dump_scores_exactly(batch, rollouts, tmp_path):
    assert batch.sequences.shape[1] > min(len(r.prompt_ids) + len(r.token_ids) for r in rollouts)  # padded
    dump = parity_openrlhf.dump_batch(batch, tmp_path / "step.parquet", sampling={"temperature": TEMPERATURE})
    out = tmp_path / "forward.json"
    assert main(["score", str(dump), "--model", "tiny-llama", "--dtype", "float32", "--json", str(out)]) == 0
    report = ParityReport.from_json(out.read_text())
    assert report.summary["max_abs_logprob_diff"] == 0.0
    assert report.summary["num_tokens"] == sum(len(r.token_ids) for r in rollouts)


def test_the_one_position_shift_is_what_makes_it_exact(batch, tmp_path):
    """Negative control: the same arrays read without undoing the shift (NeMo-RL's layout as is)."""
    from parity.integrations import nemo_rl

    data = {"generation_logprobs": batch.rollout_log_probs, "prev_logprobs": batch.action_log_probs,
            "token_mask": batch.action_mask, "input_ids": batch.sequences[:, :-1],
            "input_lengths": batch.attention_mask.sum(-1) - 1}
    dump = nemo_rl.dump_batch(data, tmp_path / "shifted.parquet", sampling={"temperature": TEMPERATURE})
    out = tmp_path / "shifted.json"
    argv = ["score", str(dump), "--model", "tiny-llama", "--dtype", "float32", "--json", str(out)]
    assert main(argv) in (0, 1)
    assert ParityReport.from_json(out.read_text()).summary["max_abs_logprob_diff"] > 1e-3


def test_log_batch_logs_what_verls_layout_logs(batch, rollouts, tmp_path):
    with parity.Monitor(tmp_path / "m", advice_every=0, render_every=0) as monitor:
        record = parity_openrlhf.log_batch(monitor, 0, batch, sampling={"temperature": TEMPERATURE})
    width = max(len(r.token_ids) for r in rollouts)
    rollout, trainer = torch.zeros(len(rollouts), width), torch.zeros(len(rollouts), width)
    mask = torch.zeros(len(rollouts), width, dtype=torch.long)
    for i, r in enumerate(rollouts):
        n = len(r.token_ids)
        rollout[i, :n], mask[i, :n] = torch.tensor(r.logprobs), 1
        trainer[i, :n] = torch.from_numpy(trainer_logprobs(r)).float()
    with parity.Monitor(tmp_path / "v", advice_every=0, render_every=0) as monitor:
        want = monitor.log(0, rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask)
    for key in ("summary", "rollout_corr", "by_position"):
        assert record[key] == want[key]
    batch_without = experience.Experience.concat_experiences([one_experience(r) for r in rollouts], PAD)
    batch_without.rollout_log_probs = None
    with pytest.raises(InputError, match="is_correction_level"):
        parity_openrlhf.read_batch(batch_without)


def readme_snippet(first_line: str) -> str:
    """The README's "In your trainer" block that starts with `first_line`."""
    section = (ROOT / "README.md").read_text().split("## In your trainer\n", 1)[1].split("\n## ", 1)[0]
    return next(b for b in re.findall(r"```python\n(.*?)```", section, re.S) if b.startswith(first_line))


@pytest.mark.slow
def test_the_readme_snippet_runs_on_an_experience(batch, rollouts, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = {"experience": batch, "step": 3}
    exec(readme_snippet("# OpenRLHF"), names)
    names["monitor"].close()
    assert names["record"]["step"] == 3
    assert names["record"]["summary"]["num_tokens"] == sum(len(r.token_ids) for r in rollouts)
    assert (tmp_path / "runs/ppo/parity/monitor.sqlite").is_file()
