"""No silent wrong numbers, round 5, the trainers' batches (`parity.integrations`): each batch below
was read on the old code into a monitor record or a rollout dump with tokens dropped, counted twice or
shifted, or with a prompt cut at the wrong place; each is now an `InputError` naming the field and how
the two fields disagree. Positive controls: the same batches laid out as each framework lays them out
still read, with every counted token.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_integrations import DataProtoLike, TensorDictLike

import parity
from parity.core.errors import InputError
from parity.integrations import nemo_rl, openrlhf, trl, verl
from parity.integrations.batches import StepBatch, dump_step
from parity.rollouts.dumps import read_dump


def proto(batch: TensorDictLike) -> DataProtoLike:
    """verl's DataProto of `batch`, sampled at temperature 1."""
    return DataProtoLike(batch, meta_info={"temperature": 1.0})


def verl_tensors() -> TensorDictLike:
    """2 rows as verl's fit holds them: prompts left-padded to 3, responses right-padded to 4."""
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]])
    rollout = torch.tensor([[-1.0, -2.0, -3.0, -1.0], [-1.0, -2.0, -1.0, -1.0]])
    return TensorDictLike(prompts=torch.tensor([[0, 5, 6], [7, 8, 9]]),
                          responses=torch.tensor([[11, 12, 13, 0], [14, 15, 0, 0]]),
                          attention_mask=attention, response_mask=attention[:, 3:].clone(),
                          rollout_log_probs=rollout, old_log_probs=rollout - 0.1)


def nemo_rl_data() -> dict:
    """One NeMo-RL row: prompt 5 6, response 7 8 (logprob of token i at position i), one pad column."""
    logprobs = torch.tensor([[0.0, -1.0, -1.0, -2.0, 0.0]])
    return {"generation_logprobs": logprobs, "prev_logprobs": logprobs - 0.1,
            "token_mask": torch.tensor([[0, 0, 1, 1, 0]]), "input_ids": torch.tensor([[5, 6, 7, 8, 0]]),
            "input_lengths": torch.tensor([4])}


def experience(*, left_padded: bool) -> SimpleNamespace:
    """One OpenRLHF row, prompt 5 6 and response 7 8 9, padded by 2 on the right (OpenRLHF 0.11) or the
    left (older OpenRLHF); per-action arrays shifted by one (`action_mask = mask[1:]`)."""
    tokens, real = [5, 6, 7, 8, 9], [1] * 5
    action = [0, 0, 1, 1, 1]
    lp = [0.0, 0.0, -1.0, -2.0, -3.0]
    pad = (lambda x, v: [v, v, *x]) if left_padded else (lambda x, v: [*x, v, v])
    action_mask, rollout = torch.tensor([pad(action, 0)[1:]]), torch.tensor([pad(lp, 0.0)[1:]])
    return SimpleNamespace(sequences=torch.tensor([pad(tokens, 0)]),
                           attention_mask=torch.tensor([pad(real, 0)]),
                           action_mask=action_mask, rollout_log_probs=rollout,
                           action_log_probs=rollout - 0.1 * action_mask)


def counted(step) -> int:
    return int(np.asarray(step.mask).sum())


# -- verl: response_mask, attention_mask and prompts must describe one padding --------------------------


def test_verl_reads_its_own_layout_with_every_token():
    step = verl.read_batch(proto(verl_tensors()))
    assert counted(step) == 5 and step.lengths.tolist() == [3, 2]
    assert [p.tolist() for p in step.prompts] == [[5, 6], [7, 8, 9]]


def test_verl_a_counted_token_that_attention_mask_calls_padding_is_refused(tmp_path):
    """Old: the monitor counted 6 tokens and the dump of the same batch held 5 (cut at attention's length)."""
    t = verl_tensors()
    t["response_mask"] = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with pytest.raises(InputError, match=r"row 0: response_mask is 1 at position 3, but attention_mask's "
                                         r"response part ends the row at 3"):
        verl.read_batch(proto(t))
    with parity.Monitor(tmp_path / "m", advice_every=0, render_every=0) as monitor:
        with pytest.raises(InputError, match="response_mask is 1 at position 3"):
            verl.log_batch(monitor, 0, proto(t))
        assert monitor.last_step is None
    with pytest.raises(InputError, match="response_mask is 1 at position 3"):
        verl.dump_batch(proto(t), tmp_path / "d.jsonl")
    assert not (tmp_path / "d.jsonl").exists()


def test_verl_a_response_part_with_a_hole_is_refused():
    t = verl_tensors()
    t["attention_mask"][0, 4] = 0  # response part [1, 0, 1, 0]: not right-padded
    t["response_mask"] = t["attention_mask"][:, 3:].clone()
    with pytest.raises(InputError, match=r"row 0: attention_mask's response part is not right-padded"):
        verl.read_batch(proto(t))


def test_verl_a_right_padded_prompt_is_refused():
    """Old: prompt [5, 6, pad] with attention [1, 1, 0] was read as [6, 0] (cut from the left)."""
    t = verl_tensors()
    t["prompts"] = torch.tensor([[5, 6, 0], [7, 8, 9]])
    t["attention_mask"][0, :3] = torch.tensor([1, 1, 0])
    with pytest.raises(InputError, match=r"row 0: attention_mask's prompt part is not left-padded"):
        verl.read_batch(proto(t))


def test_verl_prompts_that_do_not_span_attention_mask_are_refused():
    """Old: prompts 4 wide against attention's 3 prompt columns gave prompts with a pad id or a response
    token in them."""
    t = verl_tensors()
    t["prompts"] = torch.tensor([[1, 0, 5, 6], [1, 7, 8, 9]])
    with pytest.raises(InputError, match=r"prompts \[2, 4\] and responses \[2, 4\] must together span "
                                         r"attention_mask \[2, 7\]"):
        verl.read_batch(proto(t))


def test_verl_dump_refuses_logprobs_of_another_width_as_log_does(tmp_path):
    """Old: log_batch refused old_log_probs [2, 6] against response_mask [2, 4], dump_batch wrote it."""
    t = verl_tensors()
    t["old_log_probs"] = torch.cat([t["old_log_probs"], torch.zeros(2, 2)], 1)
    with pytest.raises(InputError, match=r"trainer logprobs \[2, 6\] and the response mask \[2, 4\] differ"):
        verl.dump_batch(proto(t), tmp_path / "d.jsonl")
    assert not (tmp_path / "d.jsonl").exists()


# -- dump_step: one row's ids, logprobs and mask have one length ----------------------------------------


def step_batch(**over) -> StepBatch:
    fields = dict(rollout=np.full((1, 3), -1.0, np.float32), trainer=np.full((1, 3), -1.1, np.float32),
                  mask=np.ones((1, 3), bool), lengths=np.array([3]), responses=np.array([[1, 2, 3]]),
                  prompts=[np.array([4])], sampling={"temperature": 1.0})
    return StepBatch(**{**fields, **over})


def test_dump_step_writes_a_consistent_batch(tmp_path):
    got = read_dump(dump_step(step_batch(), tmp_path / "d.jsonl")).rollouts[0]
    assert got.token_ids == (1, 2, 3) and len(got.logprobs) == 3


@pytest.mark.parametrize("over, says", [
    # old: response_ids [1, 2] were written beside 3 logprobs, and read back as 2 tokens with 2 logprobs
    ({"responses": np.array([[1, 2]])}, r"responses \[1, 2\] and the response mask \[1, 3\] differ"),
    ({"rollout": np.full((1, 5), -1.0, np.float32)}, r"rollout logprobs \[1, 5\] and the response mask"),
    # old: lengths past the mask's width sliced short arrays silently
    ({"lengths": np.array([4])}, r"the response lengths says row 0 has 4 tokens, outside \[0, 3\]"),
    # old: the counted third token was left out of the dump (cut at the row's length)
    ({"lengths": np.array([2])}, r"row 0: the response mask is 1 at position 2, but the response lengths"),
    ({"prompts": [np.array([4]), np.array([5])]}, r"the batch has 2 prompts for 1 rows"),
])
def test_dump_step_refuses_rows_whose_parts_disagree(tmp_path, over, says):
    with pytest.raises(InputError, match=says):
        dump_step(step_batch(**over), tmp_path / "d.jsonl")
    assert not (tmp_path / "d.jsonl").exists()


# -- NeMo-RL: token_mask, input_lengths and the arrays share one [batch, seq] ---------------------------


def test_nemo_rl_reads_its_own_layout_with_every_token():
    step = nemo_rl.read_batch(nemo_rl_data())
    assert counted(step) == 2 and step.responses.tolist() == [[7, 8]]
    assert step.rollout.tolist() == [[-1.0, -2.0]]


def test_nemo_rl_a_generated_token_past_input_lengths_is_refused():
    """Old: token_mask 1 at 2..5 with input_lengths 4 counted 2 of the 4 tokens."""
    data = nemo_rl_data()
    data["token_mask"] = torch.tensor([[0, 0, 1, 1, 1]])
    with pytest.raises(InputError, match=r"row 0: token_mask is 1 at position 4, but input_lengths ends the "
                                         r"row at 4"):
        nemo_rl.read_batch(data)


def test_nemo_rl_input_lengths_past_the_sequences_are_refused():
    """Old: input_lengths 7 for 5 columns repeated the last column: token 0 counted three times."""
    data = nemo_rl_data()
    data["input_lengths"] = torch.tensor([7])
    with pytest.raises(InputError, match=r"input_lengths says row 0 has 7 tokens, outside \[0, 5\]"):
        nemo_rl.read_batch(data)
    data["input_lengths"] = torch.tensor([4, 4])
    with pytest.raises(InputError, match=r"input_lengths has shape \[2\]; give one length per row \(1\)"):
        nemo_rl.read_batch(data)


@pytest.mark.parametrize("key", ["prev_logprobs", "generation_logprobs", "input_ids"])
def test_nemo_rl_an_array_of_another_width_is_refused(tmp_path, key):
    """Old: prev_logprobs one column wider (shifted by one) was read position by position, and the
    monitor stored its 0.5 nats of misalignment as drift."""
    data = nemo_rl_data()
    data[key] = torch.cat([torch.zeros(1, 1, dtype=data[key].dtype), data[key]], 1)
    with pytest.raises(InputError, match=rf"{key} \[1, 6\] and token_mask \[1, 5\] differ in shape"):
        nemo_rl.read_batch(data)
    with parity.Monitor(tmp_path / "m", advice_every=0, render_every=0) as monitor:
        with pytest.raises(InputError, match="differ in shape"):
            nemo_rl.log_batch(monitor, 0, data, sampling={"temperature": 1.0})
        assert monitor.last_step is None


def test_nemo_rl_a_sample_mask_of_another_size_is_refused():
    data = nemo_rl_data()
    data["sample_mask"] = torch.ones(2)
    with pytest.raises(InputError, match="sample_mask has 2 entries for a batch of 1"):
        nemo_rl.read_batch(data)


# -- OpenRLHF: right-padded whole sequences only --------------------------------------------------------


def test_openrlhf_reads_its_right_padded_layout_with_every_token():
    step = openrlhf.read_batch(experience(left_padded=False))
    assert counted(step) == 3 and step.responses.tolist() == [[7, 8, 9]]
    assert [p.tolist() for p in step.prompts] == [[5, 6]] and step.rollout.tolist() == [[-1.0, -2.0, -3.0]]


def test_openrlhf_a_left_padded_batch_is_refused(tmp_path):
    """Old: attention_mask.sum() taken as the end of a left-padded row kept 1 of its 3 response tokens."""
    with pytest.raises(InputError, match=r"row 0: attention_mask is not ones then zeros: OpenRLHF 0\.11 "
                                         r"right-pads"):
        openrlhf.read_batch(experience(left_padded=True))
    with parity.Monitor(tmp_path / "m", advice_every=0, render_every=0) as monitor:
        with pytest.raises(InputError, match="attention_mask is not ones then zeros"):
            openrlhf.log_batch(monitor, 0, experience(left_padded=True), sampling={"temperature": 1.0})
        assert monitor.last_step is None


def test_openrlhf_an_action_past_attention_mask_is_refused():
    e = experience(left_padded=False)
    e.attention_mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0]])  # says the row ends before token 9
    with pytest.raises(InputError, match=r"row 0: action_mask \(shifted back by one\) is 1 at position 4, "
                                         r"but attention_mask ends the row at 4"):
        openrlhf.read_batch(e)


# -- TRL: every per-token array has completion_mask's shape ---------------------------------------------


def trl_output(**over) -> dict:
    logps = torch.tensor([[-1.0, -2.0, 0.0], [-1.5, -0.5, -0.2]])
    return {"sampling_per_token_logps": logps, "old_per_token_logps": logps - 0.1,
            "completion_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]), **over}


def test_trl_reads_its_output():
    step, nan = trl.read_output(trl_output(tool_mask=torch.tensor([[1, 1, 1], [1, 0, 1]])))
    assert nan == 0 and step.mask.tolist() == [[True, True, False], [True, False, True]]


@pytest.mark.parametrize("key, value", [
    ("sampling_per_token_logps", torch.full((2, 4), -1.0)),  # old: numpy's broadcast ValueError
    ("old_per_token_logps", torch.full((2, 4), -1.0)),
    ("tool_mask", torch.ones(2, 1, dtype=torch.int64)),      # old: broadcast silently over the row
])
def test_trl_a_per_token_array_of_another_shape_is_refused(key, value):
    with pytest.raises(InputError, match=rf"{key} \[2, (4|1)\] and completion_mask \[2, 3\] differ in shape"):
        trl.read_output(trl_output(**{key: value}))
