"""The gold forward: float64 logprobs of the same tokens under the same definition, from the same weights."""

import numpy as np
import pytest
import torch
import variant_gemm
from transformers import AutoModelForCausalLM

from parity.core.errors import ConfigError, InputError
from parity.core.types import Request, SamplingParams
from parity.engine import ReferenceEngine, train_forward
from parity.engine.gold import gold_logprobs, gold_model
from parity.models import resolve_model
from parity.models.loading import load_model
from parity.monitor.summary import bounded_threads
from parity.parallel import Comm, shard_model

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral"]
#: unit roundoff of each training dtype (half the distance from 1 to the next number).
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}

_rollouts: dict[tuple[str, str], list] = {}


def sampled(model, mode="processed"):
    """Rollouts of `model` from the float32 reference engine: realistic tokens (temperature 0.8,
    top-p 0.9 for processed logprobs; plain sampling for raw ones), 8 sequences of up to 48 tokens."""
    key = (model, mode)
    if key not in _rollouts:
        params = {"temperature": 0.8, "top_p": 0.9} if mode == "processed" else {}
        requests = [Request(tuple(range(3, 3 + n)), SamplingParams(n=2, max_tokens=48, seed=n,
                                                                   logprobs_mode=mode, **params),
                            request_id=str(n)) for n in (3, 9, 17, 30)]
        with ReferenceEngine(model, dtype="float32") as engine:
            _rollouts[key] = engine.generate(requests)
    return _rollouts[key]


def errors(rollouts, gold, other):
    """|other - gold| over the tokens both give a finite logprob, float64 [tokens]."""
    g = np.concatenate(gold)
    o = np.concatenate([np.asarray(x, np.float64) for x in other])
    keep = np.isfinite(g) & np.isfinite(o)
    assert keep.mean() > 0.98  # only a top-p boundary token or two falls outside either support
    return np.abs(o - g)[keep]


@pytest.mark.parametrize("mode", ["processed", "raw"])
@pytest.mark.parametrize("model", TINY)
@pytest.mark.slow
def test_float64_gold_agrees_with_a_float32_gold_to_1e_5(model, mode):
    """Sanity: the same computation in float32 lands within 1e-5 nats of the float64 one on every token."""
    rollouts = sampled(model, mode)
    gold = gold_logprobs(model, rollouts)
    assert all(g.dtype == np.float64 and g.shape == (len(r.token_ids),) for g, r in zip(gold, rollouts))
    diff = errors(rollouts, gold, gold_logprobs(model, rollouts, dtype="float32"))
    assert 0 < diff.max() <= 1e-5


@pytest.mark.parametrize("model", TINY)
@pytest.mark.slow
def test_training_forward_errors_scale_with_its_dtype_unit_roundoff(model):
    """The gold is far more accurate than any training dtype: each dtype's mean error from it is
    1-100 unit roundoffs of that dtype (bf16 ~1e-2 nats, fp16 ~1e-3, fp32 ~1e-6), so the errors
    of bf16 and fp32 are ~2^16 apart, as their precisions are."""
    rollouts = sampled(model)
    gold = gold_logprobs(model, rollouts)
    means = {}
    for dtype, u in UNIT_ROUNDOFF.items():
        train = [lp.float().numpy() for lp in train_forward(model, rollouts, dtype=dtype).logprobs]
        means[dtype] = errors(rollouts, gold, train).mean()
        assert u <= means[dtype] <= 100 * u, (dtype, means[dtype])
    assert means["bfloat16"] > 1000 * means["float32"]


def test_gold_matches_an_independent_float64_computation():
    """Raw logprobs of the gold equal a plain float64 log_softmax of a stock float64 model's logits
    to far below float32 precision (the two differ only where transformers computes in float32)."""
    rollouts = sampled("tiny-llama", "raw")
    gold = gold_logprobs("tiny-llama", rollouts)
    stock = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-llama"), dtype=torch.float64).eval()
    for ro, got in zip(rollouts, gold):
        ids = torch.tensor([[*ro.prompt_ids, *ro.token_ids]])
        with torch.no_grad():
            logits = stock(ids).logits[0, len(ro.prompt_ids) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ro.token_ids).view(-1, 1)).view(-1)
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=5e-6)


def test_float32_islands_are_widened():
    """transformers computes RMSNorm, RoPE and the router softmax in float32 whatever the dtype; the
    gold computes them in float64. Negative control: a stock float64 model, with those float32
    islands, is measurably farther from the gold than float64 rounding (~1e-6 nats here)."""
    rollouts = sampled("tiny-qwen3-moe", "raw")
    gold = gold_logprobs("tiny-qwen3-moe", rollouts)
    stock = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen3-moe"), dtype=torch.float64,
                                                 experts_implementation="eager").eval()
    worst = 0.0
    for ro, got in zip(rollouts, gold):
        with torch.no_grad():
            ids = torch.tensor([[*ro.prompt_ids, *ro.token_ids]])
            logits = stock(ids).logits[0, len(ro.prompt_ids) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ro.token_ids).view(-1, 1)).view(-1)
        worst = max(worst, float(np.abs(got - want.numpy()).max()))
    assert 1e-8 < worst < 1e-4


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe", "tiny-mixtral"])
def test_widened_modules_compute_transformers_formula_in_float32(model):
    """In float32 the gold's RMSNorm and router are transformers' own computation, bit for bit (only
    the dtype they run in changes), and its rotary cos/sin are transformers' within float32 rounding."""
    gold = gold_model(model, dtype="float32", device="cpu")
    stock = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32,
                                                 experts_implementation="eager").eval()
    x = torch.randn(5, 7, gold.config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(7).repeat(5, 1) * 37
    pairs = zip(dict(gold.named_modules()).items(), dict(stock.named_modules()).values())
    checked = set()
    with torch.no_grad():
        for (name, ours), theirs in pairs:
            kind = type(theirs).__name__
            if kind.endswith("RMSNorm") and ours.weight.shape[-1] == x.shape[-1]:
                assert torch.equal(ours(x), type(theirs).forward(theirs, x)), name
            elif kind.endswith("TopKRouter"):
                for a, b in zip(ours(x), type(theirs).forward(theirs, x)):
                    assert torch.equal(a, b), name
            elif kind.endswith("RotaryEmbedding"):
                for a, b in zip(ours(x, positions), type(theirs).forward(theirs, x, positions)):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
            else:
                continue
            checked.add(kind[-len("RMSNorm"):] if kind.endswith("RMSNorm") else kind)
    assert "RMSNorm" in checked and any(k.endswith("RotaryEmbedding") for k in checked)


def test_in_memory_weights_are_read_on_every_call():
    """A LoadedModel's gold takes the weights it has now (an RL policy moves between steps): the same
    numbers as its checkpoint until a weight changes, different ones after."""
    rollouts = sampled("tiny-llama")
    lm = load_model("tiny-llama", dtype="float32")
    from_checkpoint = gold_logprobs("tiny-llama", rollouts)
    before = gold_logprobs(lm, rollouts)
    assert all(np.array_equal(a, b) for a, b in zip(before, from_checkpoint))
    weight = lm.model.lm_head.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(1.01)
        after = gold_logprobs(lm, rollouts)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert not any(np.array_equal(a, b) for a, b in zip(before, after))
    assert all(np.array_equal(a, b) for a, b in zip(gold_logprobs(lm, rollouts), before))


def test_batching_and_order_change_nothing_beyond_float64_rounding():
    rollouts = sampled("tiny-qwen3")
    whole = gold_logprobs("tiny-qwen3", rollouts)
    single = gold_logprobs("tiny-qwen3", rollouts[::-1], batch_tokens=1)[::-1]
    for a, b in zip(whole, single):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def test_gold_bits_do_not_follow_the_callers_thread_count(monkeypatch):
    """The gold runs on one thread, so its float64 bits are the same whatever threads the caller set
    (a report's gold figures reproduce on any host). Whether this host's BLAS splits a float64 GEMM's
    sum by thread is the host's business (an AMX Xeon's does, an AVX2 EPYC's does not), so the test
    also runs under a stock linear that does on purpose (`variant_gemm.by_threads`): the gold's bits
    still hold, and the negative control, left at the caller's thread count, changes them."""
    import contextlib

    from parity.engine import gold as gold_module

    rollouts = sampled("tiny-llama", "raw")
    threads = torch.get_num_threads()

    def at(n):
        with bounded_threads(n):
            return np.concatenate(gold_logprobs("tiny-llama", rollouts))

    assert np.array_equal(at(1), at(2)) and torch.get_num_threads() == threads
    variant_gemm.use(monkeypatch, variant_gemm.by_threads)
    assert np.array_equal(at(1), at(2))
    monkeypatch.setattr(gold_module, "_gold_settings", lambda kind: contextlib.nullcontext())
    assert not np.array_equal(at(1), at(2))


def test_definition_follows_each_rollout():
    """Each rollout is scored under the sampling it records; a pair, which records none, under an
    unmodified softmax (the raw logprobs); greedy is a point mass on the gold's own argmax."""
    rollouts = sampled("tiny-llama")
    processed = np.concatenate(gold_logprobs("tiny-llama", rollouts))
    raw = np.concatenate(gold_logprobs("tiny-llama", rollouts, logprobs_mode="raw"))
    assert (processed != raw).mean() > 0.9  # temperature 0.8 and top-p 0.9 change nearly every token
    pairs = [(ro.prompt_ids, ro.token_ids) for ro in rollouts]
    assert np.array_equal(np.concatenate(gold_logprobs("tiny-llama", pairs)), raw)
    greedy = gold_logprobs("tiny-llama", pairs, temperature=0.0)
    assert all(set(g.tolist()) <= {0.0, -np.inf} for g in greedy)


def test_bad_input_is_refused_before_any_forward():
    pairs = [((3, 4, 5), (6, 7))]
    with pytest.raises(ConfigError, match="gold dtype"):
        gold_logprobs("tiny-llama", pairs, dtype="bfloat16")
    with pytest.raises(InputError, match="prompt_ids is empty"):
        gold_logprobs("tiny-llama", [((), (6,))])
    with pytest.raises(InputError, match="outside the vocabulary"):
        gold_logprobs("tiny-llama", [((3, 4), (99999,))])
    with pytest.raises(InputError, match="exceed the context"):
        gold_logprobs("tiny-llama", [((3,) * 600, (4,))])
    with pytest.raises(ConfigError, match="batch_tokens"):
        gold_logprobs("tiny-llama", pairs, batch_tokens=0)
    with pytest.raises(ConfigError, match="device"):
        gold_logprobs("tiny-llama", pairs, device="tpu")
    shard = shard_model("tiny-llama", Comm.single(), dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="whole model"):
        gold_logprobs(shard, pairs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
@pytest.mark.parametrize("model", TINY)
def test_cuda_gold_is_float32_without_tf32_and_agrees_with_the_cpu_float64_one(model):
    """On CUDA the gold runs float32 with TF32 and reduced-precision reductions off: within 1e-5 of
    the CPU float64 gold (TF32's 10-bit mantissa would be ~1e-3 off), and the settings come back."""
    rollouts = sampled(model)
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
              torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    cuda = gold_logprobs(model, rollouts, device="cuda")
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction) == before
    diff = errors(rollouts, gold_logprobs(model, rollouts), cuda)
    assert diff.max() <= 1e-5
