"""The training forward: correct logprobs, bitwise independent of layout and micro-batching."""

import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from parity.engine import LAYOUTS, TrainResult, train_forward
from parity.engine.sampler import RowParams, processed_logprobs
from parity.errors import ConfigError, InputError
from parity.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _pairs(seed, count, max_len=40):
    rng = random.Random(seed)
    return [(tuple(rng.randrange(3, 512) for _ in range(rng.randrange(1, max_len))),
             tuple(rng.randrange(3, 512) for _ in range(rng.randrange(0, 12)))) for _ in range(count)]


@pytest.mark.parametrize("kernels", ["invariant", "native"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"])
def test_raw_logprobs_match_stock_hf_model(model, kernels):
    """The patched model computes the same function as transformers' own (within fp32 rounding)."""
    pairs = _pairs(1, 3)
    ours = train_forward(model, pairs, kernels=kernels, logprobs_mode="raw", layout="left").logprobs
    hf = AutoModelForCausalLM.from_pretrained(load_model(model).path, attn_implementation="eager").eval()
    for (prompt, response), got in zip(pairs, ours):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + response])).logits[0].float()
        want = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(response).view(-1, 1))
        torch.testing.assert_close(got, want.view(-1), rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@given(seed=st.integers(0, 2**16), count=st.integers(1, 6), micro=st.integers(1, 6),
       layout=st.sampled_from(LAYOUTS), temperature=st.sampled_from([0.0, 0.8, 1.0]),
       top_k=st.sampled_from([0, 3]), top_p=st.sampled_from([1.0, 0.7]))
def test_layout_and_micro_batch_do_not_change_bits(dtype, seed, count, micro, layout, temperature, top_k,
                                                   top_p):
    pairs = _pairs(seed, count)
    params = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "dtype": dtype}
    base = train_forward("tiny-qwen3-moe", pairs, layout="right", **params).logprobs
    other = train_forward("tiny-qwen3-moe", pairs, layout=layout, micro_batch_size=micro, **params).logprobs
    assert all(torch.equal(a, b) for a, b in zip(base, other))
    assert [len(a) for a in base] == [len(r) for _, r in pairs]


def test_native_kernels_depend_on_micro_batch():
    """Negative control: with stock kernels, micro-batching changes some logprob's bits."""
    pairs = _pairs(7, 8)
    whole = train_forward("tiny-llama", pairs, kernels="native").logprobs
    single = train_forward("tiny-llama", pairs, kernels="native", micro_batch_size=1).logprobs
    assert any(not torch.equal(a, b) for a, b in zip(whole, single))


def test_processed_semantics():
    pairs = _pairs(3, 4)
    greedy = train_forward("tiny-llama", pairs, temperature=0.0).logprobs
    assert all(set(x.tolist()) <= {0.0, -math.inf} for x in greedy)
    top1 = train_forward("tiny-llama", pairs, top_k=1).logprobs
    assert all(torch.equal(a, b) for a, b in zip(greedy, top1))
    plain = train_forward("tiny-llama", pairs).logprobs
    raw = train_forward("tiny-llama", pairs, logprobs_mode="raw").logprobs
    assert all(torch.equal(a, b) for a, b in zip(plain, raw))
    hot = train_forward("tiny-llama", pairs, temperature=[2.0, 1.0, 1.0, 1.0]).logprobs
    assert not torch.equal(hot[0], plain[0]) and torch.equal(hot[1], plain[1])


def test_top_p_and_top_k_keep_the_documented_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9], [0.4, 0.2, 0.2, 0.2]]))
    params = RowParams((1.0, 1.0), (0, 2), (0.6, 1.0))
    lp = processed_logprobs(logits, params)
    # Row 0: the mass before token 1 is 0.5 < 0.6, before token 2 it is 0.8 -> keep {0, 1}.
    torch.testing.assert_close(lp[0, :2].exp(), torch.tensor([0.5, 0.3]) / 0.8)
    assert lp[0, 2:].eq(-math.inf).all()
    # Row 1: top-2 keeps every token tying the 2nd largest logit.
    assert torch.isfinite(lp[1]).all()


def test_routes_of_moe_and_dense_models():
    pairs = _pairs(5, 3)
    moe = train_forward("tiny-qwen3-moe", pairs, record_routes=True, layout="packed")
    assert len(moe.routes) == len(pairs)
    for (prompt, response), route in zip(pairs, moe.routes):
        assert route.shape == (len(prompt) + len(response) - 1, 2, 2) and route.dtype == torch.int32
    assert train_forward("tiny-llama", pairs, record_routes=True).routes == [None, None, None]
    assert train_forward("tiny-qwen3-moe", pairs).routes is None


def test_bad_input_is_a_parity_error():
    ok = [((5, 6), (7,))]
    with pytest.raises(InputError, match="prompt_ids is empty"):
        train_forward("tiny-llama", [((), (7,))])
    with pytest.raises(InputError, match="outside the vocabulary"):
        train_forward("tiny-llama", [((5, 600), (7,))])
    with pytest.raises(InputError, match="exceed the context"):
        train_forward("tiny-llama", [((5,) * 500, (7,) * 13)])
    with pytest.raises(InputError, match="one per sequence"):
        train_forward("tiny-llama", ok, temperature=[1.0, 0.5])
    with pytest.raises(InputError, match="Rollout or a"):
        train_forward("tiny-llama", [(5, 6, 7)])
    with pytest.raises(ConfigError, match="top_p"):
        train_forward("tiny-llama", ok, top_p=0.0)
    with pytest.raises(ConfigError, match="temperature"):
        train_forward("tiny-llama", ok, temperature=-0.5)
    with pytest.raises(ConfigError, match="top_k"):
        train_forward("tiny-llama", ok, top_k=-1)
    with pytest.raises(ConfigError, match="layout"):
        train_forward("tiny-llama", ok, layout="middle")
    with pytest.raises(ConfigError, match="micro_batch_size"):
        train_forward("tiny-llama", ok, micro_batch_size=0)
    with pytest.raises(ConfigError, match="logprobs_mode"):
        train_forward("tiny-llama", ok, logprobs_mode="sampled")
    assert train_forward("tiny-llama", []) == TrainResult([], None)
