"""Multi-turn trajectories in the reference engine: turns continue in place over the KV of earlier
turns, and generated tokens' logprobs equal one train_forward pass of the whole trajectory bit
for bit, whatever the other trajectories in the batch are doing."""

import dataclasses
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parity import Request, SamplingParams
from parity.assess.training_side import report_for
from parity.backends.hf import HFBackend
from parity.backends.reference import ReferenceBackend
from parity.backends.turns import generate
from parity.core.errors import ConfigError, InputError
from parity.core.turns import Generate, Inject, after_injection, turn_index
from parity.core.types import Rollout
from parity.drift.tolerance import Tolerance
from parity.engine import LAYOUTS, ReferenceEngine, train_forward
from parity.models import EOS_ID
from parity.nightly.runner import plan
from parity.rollouts.dumps import read_dump
from parity.scoring import score
from parity.workload.cases import load_case
from parity.workload.prompts import tokenizer
from parity.workload.tools import bind_tools, calculator

pytestmark = pytest.mark.usefixtures("one_thread")


def last_token_echo(history):
    """A deterministic tool: replies with three ids derived from the last generated token."""
    t = history[-1]
    return [(t * 7 + 3) % 500 + 3, (t + 11) % 500 + 3, 42]


@st.composite
def trajectories(draw, max_requests=4):
    """Trajectories at different turn counts and injection lengths, and engine/trainer settings."""
    requests = []
    for i in range(draw(st.integers(1, max_requests))):
        rng = random.Random(draw(st.integers(0, 2**16)))
        prompt = tuple(rng.randrange(3, 512) for _ in range(draw(st.integers(1, 40))))
        turns = []
        for _ in range(draw(st.integers(1, 4))):
            if draw(st.booleans()):
                fixed = tuple(rng.randrange(3, 512) for _ in range(draw(st.integers(1, 30))))
                echo = Inject(fn=last_token_echo, name="echo")
                turns.append(echo if draw(st.booleans()) else Inject(fixed))
            stops = draw(st.sampled_from([(), (100, 200)]))
            turns.append(Generate(draw(st.integers(1, 6)), stop_token_ids=stops))
        sampling = SamplingParams(
            n=draw(st.integers(1, 2)), temperature=draw(st.sampled_from([0.0, 0.7, 1.0, 1.3])),
            top_k=draw(st.sampled_from([0, 7, 40])), top_p=draw(st.sampled_from([1.0, 0.9])),
            max_tokens=draw(st.integers(4, 80)), seed=draw(st.integers(0, 2**16)),
            stop_token_ids=draw(st.sampled_from([(), (EOS_ID,)])), ignore_eos=draw(st.booleans()),
            logprobs_mode=draw(st.sampled_from(["processed", "raw"])))
        requests.append(Request(prompt, sampling, request_id=f"t{i}", turns=tuple(turns)))
    return {
        "requests": draw(st.permutations(requests)),
        "max_num_seqs": draw(st.integers(1, 5)),
        "chunk_size": draw(st.integers(1, 24)),
        "micro_batch_size": draw(st.integers(1, 8)),
        "layout": draw(st.sampled_from(LAYOUTS)),
    }


def _generated(values, rollout):
    return torch.tensor([v for v, m in zip(values, rollout.mask) if m], dtype=torch.float32)


def _rollouts_and_scores(model, dtype, kernels, work):
    engine = ReferenceEngine(model, dtype=dtype, kernels=kernels, max_num_seqs=work["max_num_seqs"],
                             chunk_size=work["chunk_size"])
    rollouts = engine.generate(work["requests"])
    scored = train_forward(model, rollouts, dtype=dtype, kernels=kernels, layout=work["layout"],
                           micro_batch_size=work["micro_batch_size"],
                           temperature=[r.sampling.temperature for r in rollouts],
                           top_k=[r.sampling.top_k for r in rollouts],
                           top_p=[r.sampling.top_p for r in rollouts])
    return rollouts, [_generated(lp.tolist(), r) for lp, r in zip(scored.logprobs, rollouts)]


@pytest.mark.parametrize("model,dtype", [("tiny-llama", "float32"), ("tiny-qwen3-moe", "bfloat16")])
@given(work=trajectories())
@pytest.mark.slow
def test_trajectory_logprobs_equal_one_train_forward_bitwise(model, dtype, work):
    rollouts, scores = _rollouts_and_scores(model, dtype, "invariant", work)
    for rollout, trained in zip(rollouts, scores):
        assert rollout.response_mask is not None
        assert len(rollout.token_ids) <= rollout.sampling.max_tokens
        assert torch.equal(trained, _generated(rollout.logprobs, rollout))


@given(work=trajectories(max_requests=3), target=st.integers(0, 2))
@pytest.mark.slow
def test_trajectory_alone_equals_trajectory_in_any_batch(work, target):
    requests = work["requests"]
    request = requests[target % len(requests)]
    crowd = ReferenceEngine("tiny-llama", max_num_seqs=work["max_num_seqs"], chunk_size=work["chunk_size"])
    alone = ReferenceEngine("tiny-llama", max_num_seqs=1, chunk_size=64)
    in_batch = [r for r in crowd.generate(requests) if r.request_id == request.request_id]
    by_itself = alone.generate([request])
    assert [(r.token_ids, r.logprobs, r.response_mask) for r in in_batch] == \
        [(r.token_ids, r.logprobs, r.response_mask) for r in by_itself]


def _mixed_turns(seed):
    """Trajectories that are at different turns in the same steps (different prompt lengths)."""
    rng = random.Random(seed)
    return [Request(tuple(rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))),
                    SamplingParams(n=2, max_tokens=40, seed=i, ignore_eos=True), request_id=str(i),
                    turns=(Generate(4), Inject(tuple(rng.randrange(3, 512) for _ in range(9))), Generate(5),
                           Inject(fn=last_token_echo, name="echo"), Generate(3)))
            for i in range(4)]


def test_native_kernels_break_trajectory_parity():
    """Negative control: stock kernels, where a continuation's KV was computed under other batch
    shapes than the one-pass training forward uses, give other bits."""
    work = {"requests": _mixed_turns(0), "max_num_seqs": 3, "chunk_size": 7, "micro_batch_size": 8,
            "layout": "right"}
    rollouts, scores = _rollouts_and_scores("tiny-llama", "float32", "native", work)
    assert any(not torch.equal(s, _generated(r.logprobs, r)) for r, s in zip(rollouts, scores))


def test_trajectory_layout_mask_and_turn_indices():
    request = Request((5, 6, 7), SamplingParams(max_tokens=30, seed=3, ignore_eos=True), request_id="a",
                      turns=(Inject((9, 9)), Generate(3), Inject((11, 12, 13)), Generate(2),
                             Inject(fn=last_token_echo, name="echo")))
    (rollout,) = ReferenceEngine("tiny-llama").generate([request])
    assert rollout.response_mask == (0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0)
    assert rollout.token_ids[:2] == (9, 9) and rollout.token_ids[5:8] == (11, 12, 13)
    assert list(rollout.token_ids[10:]) == last_token_echo(rollout.token_ids[:10])
    assert rollout.finish_reason == "stop"
    assert [lp for lp, m in zip(rollout.logprobs, rollout.mask) if not m] == [0.0] * 8
    assert turn_index(rollout.mask) == [-1, -1, 0, 0, 0, -1, -1, -1, 1, 1, -1, -1, -1]
    assert after_injection(rollout.mask) == [False, False, True, False, False, False, False, False, True,
                                             False, False, False, False]
    assert Rollout.from_dict(rollout.to_dict()) == rollout


def test_budget_cuts_an_injection_and_stop_ids_end_a_turn():
    cut = Request((5, 6), SamplingParams(max_tokens=5, seed=1, ignore_eos=True), request_id="a",
                  turns=(Generate(3), Inject(tuple(range(10, 20))), Generate(3)))
    (rollout,) = ReferenceEngine("tiny-llama").generate([cut])
    assert rollout.response_mask == (1, 1, 1, 0, 0) and rollout.token_ids[3:] == (10, 11)
    assert rollout.finish_reason == "length"
    # greedy picks the same first token twice: making it a turn's stop id ends that turn after it
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    (free,) = ReferenceEngine("tiny-llama").generate([Request((5, 6), greedy, turns=(Generate(4),))])
    stopped = Request((5, 6), greedy, turns=(Generate(4, stop_token_ids=(free.token_ids[0],)), Inject((7,)),
                                             Generate(1)))
    (rollout,) = ReferenceEngine("tiny-llama").generate([stopped])
    assert rollout.response_mask == (1, 0, 1)


def test_bad_turns_are_parity_errors():
    with pytest.raises(ConfigError, match="no Generate"):
        Request((1, 2), turns=(Inject((3,)),))
    with pytest.raises(ConfigError, match="not both"):
        Inject((3,), fn=last_token_echo)
    with pytest.raises(ConfigError, match="turns\\[0\\]"):
        Request((1, 2), turns=("generate",))
    with pytest.raises(ConfigError, match="max_tokens"):
        Generate(0)
    with pytest.raises(InputError, match="response_mask"):
        Rollout("a", 0, (1,), (2, 3), (0.0, 0.0), "stop", "x", response_mask=(1, 2))
    with pytest.raises(InputError, match="vocabulary"):
        ReferenceEngine("tiny-llama").generate([Request((1, 2), turns=(Generate(2), Inject((10**7,)),
                                                                        Generate(1)))])


class TurnByTurnReference(ReferenceBackend):
    """The reference backend driven like vLLM: every turn a fresh request holding the history."""

    native_turns = False


def test_in_place_continuation_equals_a_fresh_prefill_of_the_history():
    """Greedy (so seeds do not enter): continuing in place over the earlier turns' KV gives the
    same bits as re-prefilling the whole history each turn."""
    requests = [dataclasses.replace(r, sampling=r.sampling.replace(temperature=0.0, n=1))
                for r in _mixed_turns(1)]
    native = ReferenceEngine("tiny-llama", max_num_seqs=3, chunk_size=5).generate(requests)
    with TurnByTurnReference("tiny-llama", dtype="float32", max_num_seqs=2, chunk_size=16) as backend:
        driven = generate(backend, requests)
    assert [(r.token_ids, r.logprobs, r.response_mask) for r in native] == \
        [(r.token_ids, r.logprobs, r.response_mask) for r in driven]
    assert driven[0].meta["generated_turns"] == 3


def test_turn_by_turn_sampling_is_scored_exactly_too():
    with TurnByTurnReference("tiny-llama", dtype="float32") as backend:
        rollouts = generate(backend, _mixed_turns(2)[:2])
    trajectory = _mixed_turns(2)[:1]
    with HFBackend("tiny-llama", dtype="float32") as hf, \
            pytest.raises(InputError, match="multi-turn trajectory"):
        hf.generate(trajectory)  # an adapter never drops turns silently
    report = report_for("tiny-llama", rollouts, dtype="float32", device="cpu", reference="invariant",
                        router_replay=None, tolerance=Tolerance.for_backend("reference"), provenance={})
    assert report.summary["max_abs_logprob_diff"] == 0.0
    assert report.summary["num_tokens"] == sum(sum(r.mask) for r in rollouts)
    assert [row["num_tokens"] for row in report.breakdowns["by_turn"]] == [16, 20, 12]
    assert report.breakdowns["after_injection"][0]["num_tokens"] == 8


def test_calculator_tool():
    assert calculator("what is 12*7+3? and 2 - 5") == "\n<result>2-5 = -3</result>\n"
    assert calculator("12 * 7 + 3 =") == "\n<result>12*7+3 = 87</result>\n"
    assert calculator("no numbers") == "\n<result>no expression</result>\n"
    assert calculator("9" * 20 + "*2") == "\n<result>number too long</result>\n"
    (turn,) = bind_tools("tiny-llama", (Inject(name="calculator"),))
    tok = tokenizer("tiny-llama")
    assert tok.decode(turn.tokens(tuple(tok("1+2")["input_ids"]))) == "\n<result>1+2 = 3</result>\n"
    with pytest.raises(ConfigError, match="unknown tool 'abacus'"):
        bind_tools("tiny-llama", (Inject(name="abacus"),))
    with pytest.raises(ConfigError, match="no function bound"):
        Inject(name="calculator").tokens((1,))


def test_verl_multi_turn_dump_scores_as_the_native_run(tmp_path):
    """verl's multi-turn batch: left-padded prompts, responses holding tool tokens with
    response_mask 0 there (and 0 on right padding), anything in rollout_log_probs at masked
    tokens: it reads back as the trajectories and scores to the same summary."""
    requests = _mixed_turns(3)[:3]
    native = ReferenceEngine("tiny-llama", dtype="bfloat16").generate(requests)
    kwargs = dict(dtype="bfloat16", device="cpu", reference="invariant", router_replay=None,
                  tolerance=Tolerance.for_backend("reference"), provenance={})
    expected = report_for("tiny-llama", native, **kwargs)
    width_p = max(len(r.prompt_ids) for r in native)
    width_r = max(len(r.token_ids) for r in native) + 3
    rows = []
    for r in native:
        pad_p, pad_r = width_p - len(r.prompt_ids), width_r - len(r.token_ids)
        rows.append({
            "prompts": [0] * pad_p + list(r.prompt_ids), "responses": list(r.token_ids) + [0] * pad_r,
            "attention_mask": [0] * pad_p + [1] * (len(r.prompt_ids) + len(r.token_ids)) + [0] * pad_r,
            "response_mask": list(r.mask) + [0] * pad_r,
            "rollout_log_probs": [lp if m else -7.5 for lp, m in zip(r.logprobs, r.mask)] + [0.0] * pad_r,
            "uid": r.request_id, "temperature": 1.0})
    path = tmp_path / "verl-multiturn.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    dump = read_dump(path)
    assert [(r.prompt_ids, r.token_ids, r.response_mask, r.logprobs) for r in dump.rollouts] == \
        [(r.prompt_ids, r.token_ids, r.response_mask, r.logprobs) for r in native]
    scored = score(path, "tiny-llama", dtype="bfloat16")
    assert scored.summary == expected.summary
    assert scored.breakdowns["by_turn"] == expected.breakdowns["by_turn"]
    # without attention_mask, trailing zeros are padding and interior zeros injected tokens
    for row in rows:
        del row["attention_mask"]
        row["prompts"] = [t for t in row["prompts"] if t]
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    assert [r.response_mask for r in read_dump(path).rollouts] == [r.mask for r in native]


def test_library_form_and_trajectory_case_file(tmp_path):
    import parity

    report = parity.compare("tiny-llama", "reference", prompts=["What is 6*7?", [3, 4, 5]],
                            sampling=SamplingParams(n=2, max_tokens=64, seed=5), dtype="float32",
                            turns=[parity.Generate(6), parity.Inject(name="calculator"), parity.Generate(6)])
    assert report.summary["max_abs_logprob_diff"] == 0.0 and report.breakdowns["by_turn"][1]["num_tokens"] > 0
    with pytest.raises(ConfigError, match="turns apply to prompts"):
        parity.compare("tiny-llama", "reference", turns=[parity.Generate(2)])
    case = tmp_path / "t.toml"
    body = """
        kind = "trajectory"
        model = "tiny-llama"
        prefix_caching = [true, false]
        [prompts]
        token_ids = [[5, 6, 7]]
        [[turns]]
        generate = 4
        stop_token_ids = [9]
        [[turns]]
        inject = "Observation: 42"
        [[turns]]
        inject = [10, 11]
        [[turns]]
        tool = "length"
        [[turns]]
        generate = 3
        [sampling]
        max_tokens = 60
    """
    case.write_text(body)
    loaded = load_case(case)
    turns = loaded.requests[0].turns
    assert [type(t).__name__ for t in turns] == ["Generate", "Inject", "Inject", "Inject", "Generate"]
    assert turns[0].stop_token_ids == (9,) and turns[2].token_ids == (10, 11) and turns[3].name == "length"
    keys = [str(key) for key, _ in plan([loaded], ("reference", "hf", "vllm", "vllm-server"))]
    assert keys == ["t|reference|bfloat16|", "t|hf|bfloat16|", "t|vllm|bfloat16|prefix-cache-on",
                    "t|vllm-server|bfloat16|prefix-cache-on", "t|vllm|bfloat16|prefix-cache-off",
                    "t|vllm-server|bfloat16|prefix-cache-off"]
    for bad, match in [(body.replace('kind = "trajectory"', ""), "only a trajectory case has turns"),
                       (body.replace('tool = "length"', 'tool = "abacus"'), "unknown tool 'abacus'"),
                       (body.replace("generate = 3", 'inject = "x"')
                        .replace("generate = 4\n", 'inject = "y"\n').replace("stop_token_ids = [9]", ""),
                        "no Generate turn"),
                       (body.replace('inject = [10, 11]', 'inject = [10, 11]\ngenerate = 2'),
                        "exactly one of generate, inject, tool"),
                       (body.replace("prefix_caching = [true, false]", "prefix_caching = [true, true]"),
                        "distinct")]:
        case.write_text(bad)
        with pytest.raises(ConfigError, match=match):
            load_case(case)
