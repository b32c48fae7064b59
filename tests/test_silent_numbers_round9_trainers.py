"""No silent wrong numbers, round 9, the trainers' objects (`parity.integrations`): each case below was
read on the old code into a NumPy IndexError from deep inside (a TRL prompt_mask of another shape than
prompt_ids, a one-dimensional mask in verl, NeMo-RL or OpenRLHF), a prompt that held its padding, or
a TRL record that left out what it did not measure or what it assumed: completions
`mask_truncated_completions` took out whole, a generation by a user's `rollout_func` (whose sampling
parity takes from GRPOConfig), and a trainer that computes its logprobs at another temperature than
`generation_kwargs` samples at. Positive controls: the batches and trainers as each framework fills
them by default still read as before, with no mark.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_silent_numbers_round5_trainers import experience, nemo_rl_data, proto, trl_output, verl_tensors
from test_silent_numbers_round7_trainers import grpo_trainer, monitor

from parity.core.errors import InputError
from parity.integrations import nemo_rl, openrlhf, trl, verl


def with_prompts(**over) -> dict:
    """trl_output's two completions with TRL's left-padded prompts (5 6 and 4 5 6)."""
    return trl_output(**{"prompt_ids": torch.tensor([[0, 5, 6], [4, 5, 6]]),
                         "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]), **over})


def logged_record(tmp_path, trainer: SimpleNamespace, output: dict | None = None) -> dict:
    """The record `attach` stores for one generation of `trainer` (returning `output` when given)."""
    if output is not None:
        trainer._generate_and_score_completions = lambda: output
    with monitor(tmp_path) as m:
        records, log = [], m.log
        m.log = lambda *a, **kw: records.append(log(*a, **kw)) or records[-1]
        trl.attach(trainer, m)
        trainer._generate_and_score_completions()
    assert len(records) == 1
    return records[0]


# -- TRL: a prompt_mask of another shape than prompt_ids is refused, naming the field ---------------------


@pytest.mark.parametrize("over", [
    {"prompt_mask": torch.tensor([[1, 1], [1, 1]])},             # old: IndexError (boolean index)
    {"prompt_mask": torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])},  # old: IndexError
    {"prompt_mask": torch.tensor([[0, 1, 1]])},                   # old: IndexError (index 1 out of bounds)
    {"prompt_ids": torch.tensor([[0, 5, 6], [4, 5, 6], [1, 2, 3]]),
     "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]])},  # old: prompts has 3 rows (monitor)
    {"prompt_mask": torch.tensor([1, 1])},                        # old: read, each prompt with its padding
])
def test_trl_a_prompt_mask_of_another_shape_is_refused(over):
    with pytest.raises(InputError, match=r"prompt_mask \[.*\] and prompt_ids \[.*\] must share one "
                                         r"\[batch, prompt_len\] shape, with the 2 rows of completion_mask"):
        trl.read_output(with_prompts(**over))


def test_trl_prompts_of_the_right_shape_still_read():
    """Positive control: TRL's left-padded prompts lose their padding, nothing else."""
    step, nan = trl.read_output(with_prompts())
    assert nan == 0 and [p.tolist() for p in step.prompts] == [[5, 6], [4, 5, 6]] and step.notes is None


# -- TRL: completions mask_truncated_completions took out are counted in the step's meta -----------------


def test_trl_completions_mask_truncated_completions_took_out_are_counted(tmp_path):
    """TRL's mask_truncated_completions sets a truncated completion's whole completion_mask row to 0
    (and its attention, so old_per_token_logps there are of no real context). Old: the record measured
    row 0's 2 tokens only and said nothing of the 3 truncated tokens of row 1, as long rows (those of
    largest drift) leave the drift."""
    output = trl_output(completion_mask=torch.tensor([[1, 1, 0], [0, 0, 0]]))
    output["old_per_token_logps"][1] -= 2.0  # the truncated row drifts most
    record = logged_record(tmp_path, grpo_trainer(mask_truncated_completions=True), output)
    assert record["summary"]["num_tokens"] == 2
    assert record["meta"]["trl_masked_truncated_completions"] == 1
    step, _ = trl.read_output(output)
    assert step.notes == {"trl_masked_truncated_completions": 1}


def test_trl_completions_all_kept_add_no_mark(tmp_path):
    """Positive control: every completion counted (padding and tool tokens aside), no mark."""
    output = trl_output(tool_mask=torch.tensor([[1, 1, 1], [1, 0, 1]]))
    record = logged_record(tmp_path, grpo_trainer(), output)
    assert record["summary"]["num_tokens"] == 4 and "trl_masked_truncated_completions" not in record["meta"]


def test_trl_a_generation_whose_completions_were_all_truncated_does_not_stop_training(tmp_path, caplog):
    """With mask_truncated_completions, a rank whose completions all hit max_completion_length has no
    counted token: a valid TRL generation. Old: the wrapper's `Monitor.log` raised InputError ("no
    valid token") from inside `trainer.train()` and stopped the run. Now the step is left out with a
    warning that says why, and the next generation logs."""
    trainer = grpo_trainer(mask_truncated_completions=True)
    outputs = iter([trl_output(completion_mask=torch.zeros(2, 3, dtype=torch.int64)), trl_output()])
    trainer._generate_and_score_completions = lambda: next(outputs)
    with monitor(tmp_path) as m:
        trl.attach(trainer, m)
        with caplog.at_level("WARNING", logger="parity.monitor"):
            assert trainer._generate_and_score_completions()["completion_mask"].sum() == 0
        assert m.last_step is None
        assert "step 3 not logged: no completion token counts (2 completions masked whole" in caplog.text
        trainer.state.global_step = 4
        trainer._generate_and_score_completions()
        assert m.last_step == 4


# -- TRL: a rollout_func generation and the trainer's own temperature are marked --------------------------


def test_trl_a_rollout_func_generation_is_marked(tmp_path):
    """TRL hands generation to a user's rollout_func and passes it no sampling; parity records
    GRPOConfig's. Old: the record said {'temperature': 0.7} as if vLLM had sampled at it, with nothing
    saying the logprobs came from code parity cannot see."""
    trainer = grpo_trainer(use_vllm=False, num_iterations=2, gradient_accumulation_steps=1)
    trainer.rollout_func = lambda prompts, trainer: {}
    record = logged_record(tmp_path, trainer)
    assert record["meta"]["trl_rollout_func"] is True and record["sampling"] == {"temperature": 0.7}
    assert "trl_rollout_func" not in logged_record(tmp_path / "v", grpo_trainer())["meta"]


def test_trl_a_trainer_temperature_other_than_the_rollouts_is_marked(tmp_path):
    """TRL's vLLM samples at generation_kwargs' temperature, while its old_per_token_logps divide the
    logits by GRPOConfig's. Old: the record said temperature 1.0 for both sides, and the difference of
    the two temperatures stood in the drift as the engines' mismatch."""
    trainer = grpo_trainer(generation_kwargs={"temperature": 1.0})
    record = logged_record(tmp_path, trainer)
    assert record["sampling"] == {"temperature": 1.0} and record["meta"]["trl_trainer_temperature"] == 0.7
    same = logged_record(tmp_path / "s", grpo_trainer(generation_kwargs={"temperature": 0.7, "top_p": 0.9}))
    assert "trl_trainer_temperature" not in same["meta"]


# -- a mask of one dimension: an InputError naming it, not NumPy's IndexError -----------------------------


def test_a_one_dimensional_mask_is_refused_naming_it():
    """Old: verl IndexError (tuple index out of range), NeMo-RL and OpenRLHF ValueError (not enough
    values to unpack), TRL (with every array 1-D) NumPy's AxisError."""
    t = verl_tensors()
    t["response_mask"] = t["response_mask"][0]
    with pytest.raises(InputError, match=r"response_mask must be \[batch, response_len\], got shape \[4\]"):
        verl.read_batch(proto(t))
    del t["attention_mask"]
    with pytest.raises(InputError, match=r"response_mask must be \[batch, response_len\]"):
        verl.read_batch(proto(t))
    data = nemo_rl_data()
    data["token_mask"] = data["token_mask"][0]
    with pytest.raises(InputError, match=r"token_mask must be \[batch, seq\], got shape \[5\]"):
        nemo_rl.read_batch(data)
    e = experience(left_padded=False)
    e.sequences = e.sequences[0]
    with pytest.raises(InputError, match=r"sequences must be \[batch, seq\], got shape \[7\]"):
        openrlhf.read_batch(e)
    flat = {k: v[1] for k, v in trl_output().items()}
    with pytest.raises(InputError, match=r"completion_mask must be \[batch, completion_len\], got shape "
                                         r"\[3\]"):
        trl.read_output(flat)


def test_two_dimensional_masks_still_read():
    """Positive control: each framework's own layout."""
    assert int(verl.read_batch(proto(verl_tensors())).mask.sum()) == 5
    assert int(nemo_rl.read_batch(nemo_rl_data()).mask.sum()) == 2
    assert int(openrlhf.read_batch(experience(left_padded=False)).mask.sum()) == 3
    assert int(trl.read_output(trl_output())[0].mask.sum()) == 5
