"""Round 16, the RL loop (`parity loop`): numbers that were silently wrong.

- a GRPO group of equal rewards got nonzero advantages whenever its mean did not round back to the
  reward (0.7 x 3: 1.1e-10 each; 123456789.123 x 3: 0.0146), and AdamW scales any gradient to a
  full step: a constant reward moved the policy (policy KL 2.6e-5 after one step at 0.7, 90 nats at
  123456789.123); rewards whose variance overflows float64 gave advantages of 0, silently;
- the arithmetic reward read the "a op b=" at the end of a longer expression: "12*3+4=" was
  rewarded for 7, "10-5-3=" for -8, "1.5+2=" for 7;
- NumPy integers and floats in the settings were written to the record's JSON as strings ("3");
- `parity loop` exited 0 when an update's differentiable forward differed from the no-grad one;
- with more than 10,007 prompts, step t+1's prompts took the sampling seeds of step t's;
- `record.STATUSES` left out "interrupted", a status the loop writes.
"""

import json

import numpy as np
import pytest
import torch

import parity
from parity.core.errors import EXIT_FAILED, InputError
from parity.loop.command import verdict
from parity.loop.config import LoopConfig
from parity.loop.grpo import group_advantages
from parity.loop.record import STATUSES, LoopRecord
from parity.loop.run import step_requests
from parity.loop.task import answer_of, custom_task

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-llama"


@pytest.mark.parametrize("reward", [0.1, 0.7, 1e6 + 0.1, 123456789.123])
@pytest.mark.parametrize("n", [3, 6, 7])
def test_a_group_of_equal_rewards_has_no_advantage(reward, n):
    rewards = torch.tensor([[reward] * n, [1.0] + [0.0] * (n - 1)], dtype=torch.float64)
    adv = group_advantages(rewards)
    assert torch.equal(adv[0], torch.zeros(n, dtype=torch.float64))
    assert adv[1, 0] > 0 and (adv[1, 1:] < 0).all()  # a group that differs keeps verl's advantages


def test_a_constant_reward_does_not_move_the_policy():
    record = parity.loop(MODEL, ["reference"], steps=2, prompts=2, n=3, max_tokens=4, device="cpu", lr=3e-3,
                         reward=lambda rollout: 0.7)
    assert [u["grad_norm"] for u in record.updates] == [0.0, 0.0]
    assert [row["policy_kl_from_start"] for row in record.steps] == [0.0, 0.0]


def test_rewards_whose_variance_overflows_are_refused():
    with pytest.raises(InputError, match="overflow"):
        group_advantages(torch.tensor([[1e200, -1e200]], dtype=torch.float64))
    # equal ones still teach nothing, however large
    assert torch.equal(group_advantages(torch.tensor([[1e308] * 3], dtype=torch.float64)),
                       torch.zeros(1, 3, dtype=torch.float64))


@pytest.mark.parametrize("prompt", ["12*3+4=", "10-5-3=", "10 * 5 - 3 =", "1.5+2=", "2^3+1=", "(3)+4="])
def test_the_tail_of_a_longer_expression_is_no_problem(prompt):
    assert answer_of(prompt) is None


@pytest.mark.parametrize(("prompt", "answer"), [("12+7=", 19), ("Q: 12 - 7 =", 5), ("2*-3=", -6),
                                                ("3--2=", 5), ("Step 2 12+7=", 19), ("Say it. 6*7=", 42)])
def test_a_problem_after_words_is_read(prompt, answer):
    assert answer_of(prompt) == answer


def test_numpy_settings_are_recorded_as_numbers():
    config = LoopConfig(model=MODEL, steps=np.int64(3), n=np.int64(2), seed=np.int64(5), prompts=np.int16(3),
                        max_tokens=np.int32(4), micro_batch_size=np.int64(2), weight_decay=np.float32(0.5),
                        temperature=np.float64(0.7))
    document = json.loads(json.dumps(config.to_dict(), default=str))
    for key, value in (("steps", 3), ("n", 2), ("seed", 5), ("prompts", 3), ("max_tokens", 4),
                       ("micro_batch_size", 2), ("weight_decay", 0.5), ("temperature", 0.7)):
        assert document[key] == value and type(document[key]) is type(value), key


def _record(forward_bitwise):
    row = {"step": 0, "backend": "reference", "weights_in_sync": True, "bitwise": True}
    update = {"step": 0, "loss": 0.0, "grad_norm": 0.0, "forward_bitwise": forward_bitwise, "kept_tokens": 1,
              "seconds": 0.0}
    return LoopRecord(model=MODEL, backends=["reference"], seed=0, train_on="reference", config={},
                      provenance={}, steps=[row], updates=[update], status="complete")


def test_an_update_whose_forward_was_not_bitwise_fails_the_command():
    assert verdict(_record(True)) == 0
    assert verdict(_record(False)) == EXIT_FAILED


def test_no_two_prompts_of_a_run_share_a_sampling_seed():
    task = custom_task("many", [[1, 2 + i % 7] for i in range(10_050)], lambda rollout: 0.0)
    config = LoopConfig(model=MODEL, steps=2, prompts=1)
    seeds = [r.sampling.seed for step in range(2) for r in step_requests(config, task, step)]
    assert len(set(seeds)) == len(seeds)
    few = custom_task("few", [[1, 2], [1, 3]], lambda rollout: 0.0)  # a run of fewer keeps its seeds
    assert [r.sampling.seed for r in step_requests(config, few, 1)] == [10_007, 10_008]


def test_every_status_the_loop_writes_is_listed():
    assert set(STATUSES) == {"running", "complete", "diverged", "failed", "interrupted"}
