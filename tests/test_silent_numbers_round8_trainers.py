"""No silent wrong numbers, round 8, the trainers' batches (`parity.integrations`): each case below was
read on the old code into a monitor record or a rollout dump that described something else than what
was sampled or measured: TRL sampling with min_p or a repetition penalty recorded as temperature-only,
a dump that dropped a sampling field or contradicted its logprobs_mode, tokens the trainer's own mask
removed (NeMo-RL's sample_mask, verl's rejection) gone from the drift without a word, and a copy of
verl's rollout logprobs as old_log_probs read as a measured zero drift. Positive controls: the same
batches and trainers, as each framework fills them by default, still read as before.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_silent_numbers_round5_trainers import nemo_rl_data, proto, verl_tensors
from test_silent_numbers_round7_trainers import grpo_trainer, logged_sampling, monitor

from parity.core.errors import ConfigError, InputError
from parity.integrations import nemo_rl, slime, trl, verl
from parity.rollouts.dumps import read_dump

# -- TRL: sampling parity cannot describe is refused at attach, not recorded as temperature-only ----------


@pytest.mark.parametrize(("args", "field"), [
    ({"min_p": 0.1}, "GRPOConfig min_p=0.1"),
    ({"repetition_penalty": 1.1}, "GRPOConfig repetition_penalty=1.1"),
    ({"vllm_structured_outputs_regex": "[ab]+"}, "vllm_structured_outputs_regex"),
    ({"generation_kwargs": {"min_p": 0.05}}, "generation_kwargs min_p=0.05"),
    ({"generation_kwargs": {"presence_penalty": 0.5}}, "generation_kwargs presence_penalty"),
    ({"generation_kwargs": {"frequency_penalty": 0.3}}, "generation_kwargs frequency_penalty"),
    ({"generation_kwargs": {"logit_bias": {5: 2.0}}}, "generation_kwargs logit_bias"),
    ({"repetition_penalty": 1.0, "generation_kwargs": {"repetition_penalty": 1.2}},
     "generation_kwargs repetition_penalty=1.2"),
])
def test_trl_sampling_parity_cannot_describe_is_refused(tmp_path, args, field):
    """TRL hands min_p, repetition_penalty and generation_kwargs to vLLM, whose processed logprobs are
    of that distribution. Old: attach accepted them and every record said {'temperature': 0.7}, the
    whole penalty's effect stored as train/rollout drift."""
    trainer = grpo_trainer(**args)
    method = trainer._generate_and_score_completions
    with monitor(tmp_path) as m:
        with pytest.raises(ConfigError, match=rf"{field}.*cannot describe"):
            trl.attach(trainer, m)
        assert m.last_step is None
    assert trainer._generate_and_score_completions is method  # nothing wrapped


def test_trl_sampling_settings_at_off_still_attach(tmp_path):
    """Positive control: GRPOConfig's defaults (min_p None, repetition_penalty 1.0), the same given as
    numbers, an off override of a set value, and kwargs that do not shape the distribution."""
    assert logged_sampling(tmp_path / "a", grpo_trainer(min_p=None, repetition_penalty=1.0)) == \
        {"temperature": 0.7}
    trainer = grpo_trainer(min_p=0.0, repetition_penalty=1.3, vllm_structured_outputs_regex=None,
                           generation_kwargs={"repetition_penalty": 1.0, "max_tokens": 8, "seed": 1,
                                              "logit_bias": {}, "top_p": 0.9})
    assert logged_sampling(tmp_path / "b", trainer) == {"temperature": 0.7, "top_p": 0.9}


# -- dumps: every sampling field given is written or refused, never dropped --------------------------------


def slime_data() -> dict:
    """One slime sample: prompt 5 6, response 7 8."""
    return {"rollout_log_probs": [torch.tensor([-1.0, -2.0])], "log_probs": [torch.tensor([-1.1, -2.1])],
            "loss_masks": [torch.ones(2, dtype=torch.int32)], "tokens": [torch.tensor([5, 6, 7, 8])]}


@pytest.mark.parametrize(("sampling", "says"), [
    ({"temperature": 1.0, "min_p": 0.1}, r"unknown field\(s\) \['min_p'\]"),
    ({"temperature": 1.0, "repetition_penalty": 1.1}, "repetition_penalty"),
    ({"temperature": 1.0, "logprobs_mode": "raw"}, r"logprobs_mode='raw' but the dump .*'processed'"),
])
def test_a_dump_refuses_sampling_it_would_not_write(tmp_path, sampling, says):
    """Old: the dump kept temperature/top_p/top_k and dropped the rest without a word: a min_p
    rollout written as temperature-only (which `Monitor.log` refuses for the same batch), raw logprobs
    written as processed ones that `parity score` compares with a tempered forward."""
    with pytest.raises(InputError, match=says):
        slime.dump_batch(slime_data(), tmp_path / "d.jsonl", sampling=sampling)
    with pytest.raises(InputError, match=says):
        verl.dump_batch(proto(verl_tensors()), tmp_path / "d.parquet", sampling=sampling)
    assert not (tmp_path / "d.jsonl").exists() and not (tmp_path / "d.parquet").exists()


def test_a_dump_writes_the_sampling_it_can_say(tmp_path):
    """Positive control: fields that do not shape the distribution are checked and left out; a raw
    dump given the same mode in sampling is written."""
    path = nemo_rl.dump_batch(nemo_rl_data(), tmp_path / "a.jsonl",  # slime refuses top_k (SGLang's)
                              sampling={"temperature": 0.7, "top_k": 20, "seed": 3, "max_tokens": 4})
    got = read_dump(path).rollouts[0]
    assert (got.sampling.temperature, got.sampling.top_k, got.logprobs_mode) == (0.7, 20, "processed")
    path = slime.dump_batch(slime_data(), tmp_path / "b.jsonl", logprobs_mode="raw",
                            sampling={"temperature": 0.7, "logprobs_mode": "raw"})
    assert read_dump(path).rollouts[0].logprobs_mode == "raw"


# -- NeMo-RL: sequences its sample_mask drops are counted in the step's meta -------------------------------


def two_nemo_rows() -> dict:
    """nemo_rl_data's row twice, the second of larger drift."""
    data = {k: torch.cat([v, v]) for k, v in nemo_rl_data().items()}
    data["prev_logprobs"][1] -= 2.0
    return data


def test_nemo_rl_tokens_sample_mask_drops_are_counted(tmp_path):
    """compute_and_apply_seq_logprob_error_masking sets sample_mask 0 for the sequences of largest
    drift (float 0./1.). Old: a log after it stored mean |Δ| 0.1 of row 0 only, the 2.1 of row 1 gone,
    and nothing in the record said two tokens were left out."""
    data = two_nemo_rows()
    data["sample_mask"] = torch.tensor([1.0, 0.0])
    with monitor(tmp_path) as m:
        record = nemo_rl.log_batch(m, 0, data, sampling={"temperature": 1.0}, meta={"epoch": 2})
    assert record["summary"]["num_tokens"] == 2
    assert record["meta"] == {"nemo_rl_sample_mask_dropped_tokens": 2, "epoch": 2}


def test_nemo_rl_a_full_sample_mask_adds_nothing(tmp_path):
    """Positive control: every sequence kept, the meta is the caller's."""
    data = two_nemo_rows()
    data["sample_mask"] = torch.ones(2)
    with monitor(tmp_path) as m:
        record = nemo_rl.log_batch(m, 0, data, sampling={"temperature": 1.0}, meta={"epoch": 2})
    assert record["summary"]["num_tokens"] == 4 and record["meta"] == {"epoch": 2}


# -- verl: tokens response_mask leaves out, and old_log_probs that copy the rollout's, are marked ----------


def test_verl_response_tokens_the_mask_rejected_are_counted(tmp_path):
    """verl's compute_rollout_correction_and_add_to_batch replaces response_mask with
    `response_mask * final_mask` (rollout_rs rejection). Old: a log after it measured the kept tokens
    only and the record did not say one response token was left out."""
    t = verl_tensors()
    t["old_log_probs"][0, 2] -= 3.0  # the token of largest drift ...
    t["response_mask"][0, 2] = 0  # ... rejected by verl
    with monitor(tmp_path) as m:
        record = verl.log_batch(m, 0, proto(t))
    assert record["summary"]["num_tokens"] == 4
    assert record["meta"] == {"verl_masked_response_tokens": 1}


def test_verl_old_log_probs_copied_from_the_rollout_are_marked(tmp_path):
    """Bypass mode sets old_log_probs = rollout_log_probs; a batch copied after it (TensorDict `.to`,
    `reorder`, verl's KV store) holds two tensors of one value. Old: the identity check missed the copy
    and the record stored a zero drift with nothing saying it was no measurement."""
    t = verl_tensors()
    t["old_log_probs"] = t["rollout_log_probs"].clone()
    with monitor(tmp_path) as m:
        record = verl.log_batch(m, 0, proto(t), meta={"epoch": 1})
    assert record["summary"]["max_abs_logprob_diff"] == 0.0
    assert record["meta"] == {"verl_old_log_probs_equal_rollout": True, "epoch": 1}
    t["old_log_probs"] = t["rollout_log_probs"]  # the same tensor: still refused
    with pytest.raises(InputError, match="bypass mode"):
        verl.read_batch(proto(t))


def test_verl_a_measured_batch_adds_nothing():
    """Positive control: a batch verl's fit leaves (old_log_probs computed, mask untouched)."""
    assert verl.read_batch(proto(verl_tensors())).notes is None
    assert verl.read_batch(SimpleNamespace(batch={k: v for k, v in verl_tensors().items()
                                                  if k != "attention_mask"}, meta_info={})).notes is None
