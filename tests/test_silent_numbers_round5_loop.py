"""Round 5, the RL loop (`parity loop`): numbers that were silently wrong.

- the GRPO groups were read off the position of each rollout a backend returned, so a backend (a
  borrowed one of the caller's) that returned its samples in another order than request, then sample
  index, had each prompt's advantages taken over other prompts' responses, and one that repeated a
  sample in place of another trained on it twice; the loop now groups by (request, sample index) and
  refuses a repeated, missing or invented sample;
- the arithmetic task's reward compared the response's leading integer by value, so "019" earned the
  full reward for 19 and "-0" or "00" for 0; it now compares the digits as written.
"""

import dataclasses

import pytest

import parity
from parity.backends.reference import ReferenceBackend
from parity.core.errors import BackendError
from parity.loop.task import FORMAT_CREDIT, arithmetic_reward

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-llama"
#: a short loop: 2 prompts x 2 responses x 4 tokens.
SHORT = {"prompts": 2, "n": 2, "max_tokens": 4, "device": "cpu"}


def _by_prompt(rollout):
    """A reward of the prompt alone: every GRPO group is constant, so every advantage is 0."""
    return 1.0 if rollout.request_id == "p0" else 0.0


class _SampleMajor(ReferenceBackend):
    """Every prompt's sample 0, then every prompt's sample 1: one sample per key, another order."""

    def generate(self, requests):
        return sorted(super().generate(requests), key=lambda r: (r.sample_index, r.request_id))


class _Repeats(ReferenceBackend):
    """The first sample twice in place of the second: the count the loop expects, one sample lost."""

    def generate(self, requests):
        out = super().generate(requests)
        return [out[0], dataclasses.replace(out[0]), *out[2:]]


def test_samples_out_of_order_are_grouped_by_their_prompt():
    # before: the groups mixed p0's and p1's responses, advantages +-0.7 and a gradient of norm ~10
    # from a reward that teaches nothing
    record = parity.loop(MODEL, [_SampleMajor(MODEL, dtype="float32")], steps=1, reward=_by_prompt, **SHORT)
    assert record.updates[0]["loss"] == 0.0 and record.updates[0]["grad_norm"] == 0.0
    assert record.status == "complete"


def test_a_repeated_sample_is_refused():
    with pytest.raises(BackendError, match=r"returned sample \('p0', 0\) more than once"):
        parity.loop(MODEL, [_Repeats(MODEL, dtype="float32")], steps=1, reward=_by_prompt, **SHORT)


@pytest.mark.parametrize(("text", "answer"), [("019", 19), ("007", 7), ("-0", 0), ("00", 0), ("-05", -5)])
def test_a_number_written_otherwise_is_not_the_answer(text, answer):
    assert arithmetic_reward(text, answer) == FORMAT_CREDIT  # before: 1.0
    assert arithmetic_reward(str(answer), answer) == 1.0
    assert arithmetic_reward(f" {answer} apples", answer) == 1.0


def test_a_borrowed_engine_running_an_adapter_is_refused_by_a_full_weight_loop():
    """Without lora_rank the loop pushes whole weights and verifies their digests: an engine running
    an adapter would sample with it on top of them, the digests matching (before: accepted). The
    same engine without the adapter is the control."""
    from parity.backends import get_backend
    from parity.core.errors import ConfigError

    adapted = get_backend("reference", "tiny-llama", lora="tiny-llama-lora-r8")
    try:
        with pytest.raises(ConfigError, match=r"applies LoRA adapter .*, not no adapter"):
            parity.loop("tiny-llama", [adapted], steps=1, prompts=2, n=2, max_tokens=4)
    finally:
        adapted.close()
    plain = get_backend("reference", "tiny-llama")
    try:
        assert len(parity.loop("tiny-llama", [plain], steps=1, prompts=2, n=2, max_tokens=4).steps) == 1
    finally:
        plain.close()
