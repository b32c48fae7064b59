"""verl for real: a `verl.DataProto` as verl's `RayPPOTrainer.fit` holds it after the old_log_prob
step (a tensordict batch, a NumPy `uid`, `meta_info["temperature"]`), read by
`parity.integrations.verl`; parity's `rollout_corr/*` numbers equal those verl's own
`compute_rollout_correction_and_rejection_mask` computes on the same batch.

The rollouts are parity's reference engine's (float32) and the trainer's logprobs are them drifted,
so the dump's `parity score` with the training forward is exact (0) and the drift is known. Skips
without verl (the `verl` extra: `pip install parity-harness[verl]`, see pyproject.toml)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import parity
from parity.backends import shared_backend
from parity.cli import main
from parity.core.types import Request, SamplingParams
from parity.integrations import verl as parity_verl
from parity.report.document import ParityReport

verl = pytest.importorskip("verl", reason="verl is not installed (the `verl` extra)")
rollout_corr = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def batch() -> verl.DataProto:
    """A GRPO step's DataProto: 3 prompts of different lengths (left-padded), 2 samples each,
    ragged responses (right-padded), rollout and trainer logprobs, uid per group."""
    engine = shared_backend("reference", "tiny-llama", dtype="float32")
    requests = [Request(prompt_ids=tuple(range(5, 5 + n)), request_id=f"q{i}",
                        sampling=SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=6 + 3 * i,
                                                seed=11 + i))
                for i, n in enumerate((3, 9, 5))]
    out = sorted(engine.generate(requests), key=lambda r: r.key)
    rows, width = len(out), max(len(r.token_ids) for r in out)
    plen = max(len(r.prompt_ids) for r in out)
    prompts = torch.zeros(rows, plen, dtype=torch.int64)
    responses = torch.zeros(rows, width, dtype=torch.int64)
    attention = torch.zeros(rows, plen + width, dtype=torch.int64)
    rollout = torch.zeros(rows, width)
    rng = np.random.default_rng(0)
    for i, r in enumerate(out):
        p, n = len(r.prompt_ids), len(r.token_ids)
        prompts[i, plen - p:] = torch.tensor(r.prompt_ids)
        responses[i, :n] = torch.tensor(r.token_ids)
        attention[i, plen - p:plen + n] = 1
        rollout[i, :n] = torch.tensor(r.logprobs)
    response_mask = attention[:, plen:].clone()
    noise = torch.from_numpy(rng.normal(0, 0.3, rollout.shape)).float()
    old = torch.minimum(rollout + noise, torch.tensor(0.0))
    return verl.DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": attention,
                 "input_ids": torch.cat([prompts, responses], 1), "response_mask": response_mask,
                 "rollout_log_probs": rollout, "old_log_probs": old * response_mask},
        non_tensors={"uid": np.array([r.request_id for r in out], dtype=object)},
        meta_info={"temperature": TEMPERATURE})


def verl_metrics(batch, **config) -> dict[str, float]:
    """verl's own rollout_corr metrics of the batch (its fit calls this with the algorithm's
    rollout_correction config; parity's Monitor default is token-level TIS at 2)."""
    t = batch.batch
    _, _, metrics = rollout_corr.compute_rollout_correction_and_rejection_mask(
        old_log_prob=t["old_log_probs"].double(), rollout_log_prob=t["rollout_log_probs"].double(),
        response_mask=t["response_mask"], **config)
    return metrics


def assert_same(parity_metrics: dict, verl_metrics: dict) -> None:
    """Every metric verl reports is parity's, to rounding: the sums run in other orders, and verl
    counts its fractions in float32 (1/54 is 0.018518518656 there)."""
    assert set(verl_metrics) <= set(parity_metrics), set(verl_metrics) - set(parity_metrics)
    for key, want in verl_metrics.items():
        assert parity_metrics[key] == pytest.approx(want, rel=1e-7, abs=1e-12), key


def test_log_batch_gives_verls_own_rollout_corr_metrics(batch, tmp_path):
    assert type(batch.batch).__name__ == "TensorDict"
    with parity.Monitor(tmp_path / "m", advice_every=0, render_every=0) as monitor:
        record = parity_verl.log_batch(monitor, 0, batch)
    want = verl_metrics(batch, rollout_is="token", rollout_is_threshold=2.0)
    assert "rollout_corr/rollout_is_mean" in want and want["rollout_corr/kl"] != 0
    assert_same(record["rollout_corr"], want)
    assert record["sampling"] == {"temperature": TEMPERATURE}
    assert record["summary"]["num_tokens"] == int(batch.batch["response_mask"].sum())
    # negative control: another correction in verl gives other numbers than parity's default
    other = verl_metrics(batch, rollout_is="sequence", rollout_is_threshold=2.0)
    mean = "rollout_corr/rollout_is_mean"
    assert other[mean] != pytest.approx(record["rollout_corr"][mean])


def test_a_monitor_with_verls_correction_config_agrees_with_verl(batch, tmp_path):
    config = {"rollout_is": "sequence", "rollout_is_threshold": 4.0, "rollout_rs": "token_k1",
              "rollout_rs_threshold": "0.5_2.0"}
    with parity.Monitor(tmp_path / "m", advice_every=0, render_every=0, correction=config) as monitor:
        record = parity_verl.log_batch(monitor, 0, batch)
    assert_same(record["rollout_corr"], verl_metrics(batch, **config))


def test_the_dump_of_a_real_dataproto_scores_exactly_and_as_verl_measures(batch, tmp_path):
    dump = parity_verl.dump_batch(batch, tmp_path / "step.parquet")
    out = tmp_path / "forward.json"
    assert main(["score", str(dump), "--model", "tiny-llama", "--dtype", "float32", "--json", str(out)]) == 0
    forward = ParityReport.from_json(out.read_text())
    assert forward.summary["max_abs_logprob_diff"] == 0.0  # prompts, padding, temperature came through
    assert forward.summary["num_tokens"] == int(batch.batch["response_mask"].sum())
    out = tmp_path / "trainer.json"
    assert main(["score", str(dump), "--trainer-logprobs", "--json", str(out)]) in (0, 1)
    report = ParityReport.from_json(out.read_text())
    assert_same(report.metrics, verl_metrics(batch, rollout_is="token", rollout_is_threshold=2.0))


def readme_snippet(first_line: str) -> str:
    """The README's "In your trainer" block that starts with `first_line`."""
    section = (ROOT / "README.md").read_text().split("## In your trainer\n", 1)[1].split("\n## ", 1)[0]
    return next(b for b in re.findall(r"```python\n(.*?)```", section, re.S) if b.startswith(first_line))


@pytest.mark.slow
def test_the_readme_snippet_runs_on_a_dataproto(batch, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = {"batch": batch, "step": 7}
    exec(readme_snippet("# verl"), names)
    names["monitor"].close()
    assert names["record"]["step"] == 7 and names["record"]["sampling"] == {"temperature": TEMPERATURE}
    assert "rollout_corr/rollout_is_mean" in names["record"]["rollout_corr"]
    assert (tmp_path / "runs/grpo/parity/monitor.sqlite").is_file()
