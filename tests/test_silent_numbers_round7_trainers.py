"""No silent wrong numbers, round 7, the trainers' batches (`parity.integrations`): each case below
was read on the old code into a monitor record or a rollout dump with a wrong number in it (a
placeholder read as the trainer's logprobs, a temperature stored as 0.699999988, the sampling TRL's
`generation_kwargs` replaced), or refused a trainer's own valid setting (top_k=-1, "off" in verl,
vLLM, SGLang and slime). Positive controls: the same batches, as each framework fills them, still read.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_integrations import DataProtoLike
from test_silent_numbers_round5_trainers import experience, nemo_rl_data, proto, verl_tensors

import parity
from parity.core.errors import InputError
from parity.integrations import nemo_rl, openrlhf, slime, trl, verl
from parity.rollouts.dumps import read_dump


def monitor(tmp_path, name: str = "m") -> parity.Monitor:
    return parity.Monitor(tmp_path / name, advice_every=0, render_every=0)


def slime_data() -> dict:
    """One slime sample: prompt 5 6, response 7 8."""
    return {"rollout_log_probs": [torch.tensor([-1.0, -2.0])], "log_probs": [torch.tensor([-1.1, -2.1])],
            "loss_masks": [torch.ones(2, dtype=torch.int32)], "tokens": [torch.tensor([5, 6, 7, 8])]}


# -- NeMo-RL: force_on_policy_ratio's all-zero prev_logprobs are no trainer logprobs ----------------------


def test_nemo_rl_the_zero_placeholder_of_prev_logprobs_is_refused(tmp_path):
    """NeMo-RL's grpo.py sets `prev_logprobs = zeros_like(generation_logprobs)` when
    force_on_policy_ratio skips the forward. Old: read as a policy giving every token probability 1,
    the monitor stored mean |Δlogp| 1.5 nats of drift that no engine had."""
    data = nemo_rl_data()
    data["prev_logprobs"] = torch.zeros_like(data["generation_logprobs"])
    with pytest.raises(InputError, match=r"prev_logprobs is 0 at every position .*force_on_policy_ratio"):
        nemo_rl.read_batch(data)
    with monitor(tmp_path) as m:
        with pytest.raises(InputError, match="force_on_policy_ratio"):
            nemo_rl.log_batch(m, 0, data, sampling={"temperature": 1.0})
        assert m.last_step is None
    with pytest.raises(InputError, match="force_on_policy_ratio"):
        nemo_rl.dump_batch(data, tmp_path / "d.jsonl", sampling={"temperature": 1.0})
    assert not (tmp_path / "d.jsonl").exists()


def test_nemo_rl_real_prev_logprobs_with_zeros_still_read(tmp_path):
    """Positive control: a policy that gives some tokens logprob 0, or a prompt position 0 (NeMo-RL's
    first column), is no placeholder."""
    data = nemo_rl_data()
    data["prev_logprobs"] = torch.tensor([[0.0, -0.5, 0.0, -2.1, 0.0]])
    step = nemo_rl.read_batch(data)
    assert step.trainer.tolist() == [[0.0, float(np.float32(-2.1))]]
    with monitor(tmp_path) as m:
        record = nemo_rl.log_batch(m, 0, data, sampling={"temperature": 1.0})
    assert record["summary"]["num_tokens"] == 2


# -- TRL: the sampling the rollout used -------------------------------------------------------------------


def grpo_trainer(**args) -> SimpleNamespace:
    """A GRPOTrainer as `attach` sees it: vLLM with IS correction, one generation per optimizer step."""
    settings = dict(use_vllm=True, vllm_importance_sampling_correction=True, num_iterations=1,
                    steps_per_generation=1, gradient_accumulation_steps=1, temperature=0.7, top_p=1.0,
                    top_k=0, generation_kwargs=None)
    logps = torch.tensor([[-1.0, -2.0, 0.0]])
    output = {"sampling_per_token_logps": logps, "old_per_token_logps": logps - 0.1,
              "completion_mask": torch.tensor([[1, 1, 0]]), "completion_ids": torch.tensor([[7, 8, 0]])}
    return SimpleNamespace(args=SimpleNamespace(**{**settings, **args}),
                           _generate_and_score_completions=lambda: output,
                           state=SimpleNamespace(global_step=3), model=SimpleNamespace(training=True))


def logged_sampling(tmp_path, trainer) -> dict:
    """The sampling of the record `attach` stores for one generation of `trainer`."""
    with monitor(tmp_path) as m:
        records, log = [], m.log
        m.log = lambda *a, **kw: records.append(log(*a, **kw)) or records[-1]
        trl.attach(trainer, m)
        trainer._generate_and_score_completions()
    assert [r["step"] for r in records] == [3]
    return records[0]["sampling"]


def test_trl_records_the_sampling_generation_kwargs_sets(tmp_path):
    """TRL's vLLM (and transformers) generation takes `args.generation_kwargs` over temperature, top_p
    and top_k. Old: the record said temperature 0.7 while vLLM sampled at 1.0 with top_p 0.9."""
    trainer = grpo_trainer(generation_kwargs={"temperature": 1.0, "top_p": 0.9, "max_tokens": 8})
    assert logged_sampling(tmp_path, trainer) == {"temperature": 1.0, "top_p": 0.9}
    assert logged_sampling(tmp_path / "plain", grpo_trainer(top_k=20)) == {"temperature": 0.7, "top_k": 20}


def test_trl_top_k_minus_one_is_off_as_the_module_says(tmp_path):
    """vLLM's "off", which TRL passes through. Old: `attach` accepted it and the first generation's
    log raised an InputError inside `trainer.train()`."""
    assert logged_sampling(tmp_path, grpo_trainer(top_k=-1)) == {"temperature": 0.7}


# -- sampling given as NumPy or torch scalars: written as the user wrote them -----------------------------


@pytest.mark.parametrize("temperature", [np.float32(0.7), torch.tensor(0.7)])
@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_scalar_temperature_given_to_dump_batch_is_written_as_given(tmp_path, temperature, suffix):
    """Old: Parquet stored np.float32(0.7) as 0.699999988079071 and `parity score` scored at it; JSONL
    failed with a bare TypeError (float32 / Tensor not JSON serializable)."""
    sampling = {"temperature": temperature, "top_p": np.float32(0.9)}
    for name, write in (("slime", lambda p: slime.dump_batch(slime_data(), p, sampling=sampling,
                                                             logprobs_mode="raw")),  # SGLang: untruncated
                        ("nemo_rl", lambda p: nemo_rl.dump_batch(nemo_rl_data(), p, sampling=sampling)),
                        ("openrlhf", lambda p: openrlhf.dump_batch(experience(left_padded=False), p,
                                                                   sampling=sampling))):
        got = read_dump(write(tmp_path / f"{name}.{suffix}")).rollouts[0].sampling
        assert (got.temperature, got.top_p) == (0.7, 0.9), name


def test_verl_meta_temperature_and_the_same_float32_given_agree():
    """Old: meta_info 0.7 against a given np.float32(0.7) was refused as "temperature=0.7 was given but
    the batch says 0.7", and a given torch top_p stayed a tensor in the batch's sampling."""
    batch = DataProtoLike(verl_tensors(), meta_info={"temperature": 0.7})
    step = verl.read_batch(batch, sampling={"temperature": np.float32(0.7), "top_p": torch.tensor(0.9)})
    assert step.sampling == {"temperature": 0.7, "top_p": 0.9}
    assert all(type(v) is float for v in step.sampling.values())
    with pytest.raises(InputError, match=r"temperature=0\.5 was given but the batch says 0\.7"):
        verl.read_batch(batch, sampling={"temperature": np.float32(0.5)})


# -- top_k=-1: verl's, slime's and vLLM's "off" ----------------------------------------------------------


def test_verl_rollout_top_k_default_is_off_not_an_error(tmp_path):
    """verl's `actor_rollout_ref.rollout.top_k` defaults to -1 (off), and the module says to pass top_k
    with `sampling=`. Old: the monitor refused it ("sampling.top_k must be an integer >= 0")."""
    with monitor(tmp_path) as m:
        record = verl.log_batch(m, 0, proto(verl_tensors()), sampling={"top_k": -1, "top_p": 1.0})
    assert record["sampling"] == {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    got = read_dump(verl.dump_batch(proto(verl_tensors()), tmp_path / "d.jsonl", sampling={"top_k": -1}))
    assert got.rollouts[0].sampling.top_k == 0


def test_slime_rollout_top_k_default_is_off_not_an_error(tmp_path):
    """slime's `--rollout-top-k` defaults to -1 (off)."""
    sampling = {"temperature": 1.0, "top_k": torch.tensor(-1)}
    with monitor(tmp_path) as m:
        assert slime.log_batch(m, 0, slime_data(), sampling=sampling)["sampling"] == {"temperature": 1.0,
                                                                                       "top_k": 0}
    # negative control: another negative is no setting
    with pytest.raises(InputError, match="top_k"), monitor(tmp_path, "n") as m:
        slime.log_batch(m, 0, slime_data(), sampling={"temperature": 1.0, "top_k": -2})


# -- verl's own DataProto --------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed (`verl` extra)")
def test_a_real_dataproto_with_verls_default_top_k_logs(tmp_path):
    """The same through verl's DataProto, meta_info's temperature a float32 scalar as verl's config may
    hold it, top_k from verl's rollout config (its default -1)."""
    from verl import DataProto

    t = verl_tensors()
    batch = DataProto.from_dict(tensors=dict(t), non_tensors={"uid": np.array(["a", "a"], dtype=object)},
                                meta_info={"temperature": np.float32(0.7)})
    with monitor(tmp_path) as m:
        record = verl.log_batch(m, 0, batch, sampling={"temperature": 0.7, "top_k": -1})
    assert record["sampling"] == {"temperature": 0.7, "top_k": 0}
    assert record["summary"]["num_tokens"] == 5
