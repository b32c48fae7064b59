"""Router replay in the training forward (R3, R2) and router agreement, on the tiny MoE checkpoints.

Exactness checks use zero tolerance; each has a negative control showing the check can fail.
"""

import contextlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from parity.assess.training_side import router_report
from parity.core.errors import ConfigError, InputError
from parity.core.schema import ROUTER_SUMMARY_KEYS
from parity.core.types import Request, SamplingParams
from parity.drift.routes import router_agreement
from parity.drift.tolerance import Tolerance
from parity.engine import ReferenceEngine, train_forward
from parity.kernels import ops
from parity.models import resolve_model, routing
from parity.models.loading import load_model
from parity.models.routing import RouterReplay

MOE_MODELS = ["tiny-qwen3-moe", "tiny-mixtral"]
DTYPE = "bfloat16"


def requests(count: int = 6, max_tokens: int = 12) -> list[Request]:
    """Enough positions (~300) that native kernels flip some router decisions of both tiny MoEs."""
    return [Request(tuple(range(3 + 5 * i, 12 + 7 * i)), SamplingParams(max_tokens=max_tokens, seed=10 + i),
                    request_id=f"r{i}") for i in range(count)]


def generate(model, kernels: str = "invariant", reqs=None):
    with ReferenceEngine(model, dtype=DTYPE, kernels=kernels, record_routes=True) as engine:
        return engine.generate(reqs or requests())


def max_diff(logprobs, rollouts) -> float:
    return max(float((lp - torch.tensor(ro.logprobs)).abs().max()) for lp, ro in zip(logprobs, rollouts))


def agreement(rollouts, routes) -> float:
    return router_agreement([ro.routed_experts for ro in rollouts], routes)["router_agreement"]


@pytest.fixture(scope="module", params=MOE_MODELS)
def moe(request):
    return request.param


@pytest.fixture(scope="module")
def invariant_rollouts(moe):
    return generate(moe)


@pytest.fixture(scope="module")
def native_rollouts(moe):
    """A disagreeing backend: the reference engine on stock torch kernels."""
    return generate(moe, kernels="native")


def test_r3_against_the_reference_engine_is_exact(moe, invariant_rollouts):
    scored = train_forward(moe, invariant_rollouts, dtype=DTYPE, router_replay="R3", record_routes=True)
    assert agreement(invariant_rollouts, scored.routes) == 1.0
    assert max_diff(scored.logprobs, invariant_rollouts) == 0.0


@pytest.mark.parametrize("layout, micro_batch_size", [("right", None), ("left", 2), ("packed", None),
                                                      ("right", 1)])
@pytest.mark.slow
def test_r3_forces_the_rollout_routes_in_every_layout(moe, native_rollouts, layout, micro_batch_size):
    """Native-kernel rollouts route differently from the invariant trainer; R3 makes every layout agree."""
    free = train_forward(moe, native_rollouts, dtype=DTYPE, record_routes=True).routes
    assert agreement(native_rollouts, free) < 1.0  # negative control: without replay they disagree
    used = train_forward(moe, native_rollouts, dtype=DTYPE, router_replay="R3", record_routes=True,
                         layout=layout, micro_batch_size=micro_batch_size).routes
    assert agreement(native_rollouts, used) == 1.0


def test_r3_routes_argument_overrides_the_rollouts(moe, invariant_rollouts):
    pairs = [(ro.prompt_ids, ro.token_ids) for ro in invariant_rollouts]
    given = [ro.routed_experts for ro in invariant_rollouts]
    logprobs = train_forward(moe, pairs, dtype=DTYPE, router_replay="R3", routes=given).logprobs
    assert max_diff(logprobs, invariant_rollouts) == 0.0
    shifted = [(r + 1) % 8 for r in given]  # negative control: other experts, other logprobs
    forced = train_forward(moe, pairs, dtype=DTYPE, router_replay="R3", routes=shifted, record_routes=True)
    assert router_agreement(shifted, forced.routes)["router_agreement"] == 1.0
    assert max_diff(forced.logprobs, invariant_rollouts) > 0


@pytest.mark.parametrize("replay", [RouterReplay("R2"), RouterReplay("R2", "replay")])
@pytest.mark.slow
def test_r2_replays_the_first_forward(moe, invariant_rollouts, replay):
    free = train_forward(moe, invariant_rollouts, dtype=DTYPE, kernels="native", record_routes=True)
    replayed = train_forward(moe, invariant_rollouts, dtype=DTYPE, kernels="native", router_replay=replay,
                             record_routes=True)
    assert all(torch.equal(a, b) for a, b in zip(replayed.logprobs, free.logprobs))
    assert all(torch.equal(a, b) for a, b in zip(replayed.routes, free.routes))


def tied_checkpoint(model: str, tmp_path):
    """`model` with router rows copied so experts {0,1,2} and {3,4,5} score exactly alike.

    A token whose best group is one of those triples has a three-way tie for two slots, so its
    top-2 set depends on the tie-break alone.
    """
    src = resolve_model(model)
    dst = tmp_path / f"{model}-tied"
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
            w[1] = w[2] = w[0]
            w[4] = w[5] = w[3]
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def prefer_high_index(real_topk):
    """A top-k whose ties go to the *higher* expert index: another engine's equally valid tie-break."""
    def topk(scores, k, *, normalize=False):
        values, indices = real_topk(scores.flip(-1), k, normalize=normalize)
        return values, scores.shape[-1] - 1 - indices
    return topk


@pytest.mark.slow
def test_tied_router_scores_flip_without_replay_and_cannot_with_it(tmp_path, monkeypatch):
    model = tied_checkpoint("tiny-qwen3-moe", tmp_path)
    rollouts = generate(model)  # ties to the lower index
    same = train_forward(model, rollouts, dtype=DTYPE, record_routes=True)
    assert agreement(rollouts, same.routes) == 1.0 and max_diff(same.logprobs, rollouts) == 0.0
    monkeypatch.setattr(ops, "topk", prefer_high_index(ops.topk))  # the trainer breaks ties the other way
    free = train_forward(model, rollouts, dtype=DTYPE, record_routes=True)
    assert agreement(rollouts, free.routes) < 1.0
    assert max_diff(free.logprobs, rollouts) > 0.0
    replayed = train_forward(model, rollouts, dtype=DTYPE, router_replay="R3", record_routes=True)
    assert agreement(rollouts, replayed.routes) == 1.0
    assert max_diff(replayed.logprobs, rollouts) == 0.0


@pytest.mark.parametrize("replay", [RouterReplay("R2"), RouterReplay("R2", "replay")])
@pytest.mark.slow
def test_r2_keeps_the_first_forward_routes_when_the_second_would_route_otherwise(tmp_path, monkeypatch,
                                                                                 replay):
    """R2 with a trainer whose router changes between its two forwards (as an update's new weights
    would): ties go to the lower expert index in odd forwards, the higher one in even forwards.
    R2 records the first forward's experts and forces them in the second, so the result equals the
    rollouts (which tie low); the negative control runs the same two forwards with the forcing
    switched off, and the second forward's own experts and logprobs differ."""
    model = tied_checkpoint("tiny-qwen3-moe", tmp_path)
    rollouts = generate(model)  # ties to the lower index
    forwards = [0]
    hook = load_model(model, dtype=DTYPE).model.model.register_forward_pre_hook(
        lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    low, high = ops.topk, prefer_high_index(ops.topk)
    monkeypatch.setattr(ops, "topk", lambda *a, **k: (high if forwards[0] % 2 == 0 else low)(*a, **k))
    try:
        replayed = train_forward(model, rollouts, dtype=DTYPE, router_replay=replay, record_routes=True)
        assert forwards[0] == 2
        assert agreement(rollouts, replayed.routes) == 1.0
        assert max_diff(replayed.logprobs, rollouts) == 0.0
        forwards[0] = 0
        monkeypatch.setattr(routing, "forcing", lambda forced: contextlib.nullcontext())  # replay off
        unforced = train_forward(model, rollouts, dtype=DTYPE, router_replay=replay, record_routes=True)
        assert forwards[0] == 2
        assert agreement(rollouts, unforced.routes) < 1.0
        assert max_diff(unforced.logprobs, rollouts) > 0.0
    finally:
        hook.remove()


@pytest.mark.slow
def test_router_report_shows_agreement_and_drift_with_and_without_replay(moe, native_rollouts):
    summary, section = router_report(moe, native_rollouts, dtype=DTYPE, device="cpu",
                                     kernels="invariant", router_replay=None, tolerance=Tolerance.exact())
    assert set(summary) == set(ROUTER_SUMMARY_KEYS)
    sides = section["sides"]
    assert section["replay"] == "none" and set(sides) == {"none", "R3"}
    assert summary["router_agreement"] == sides["none"]["router_agreement"] < 1.0
    assert 0 < summary["router_token_any_diff"] <= 1
    assert len(summary["router_agreement_per_layer"]) == 2
    assert sides["R3"]["router_agreement"] == 1.0 and sides["R3"]["router_token_any_diff"] == 0.0
    for side in sides.values():
        assert side["drift"]["max_abs_logprob_diff"] > 0  # native kernels drift beyond routing
        assert np.isfinite(side["drift"]["is_ratio_mean"])
    assert set(sides["R3"]["drift"]) == set(sides["none"]["drift"])
    summary_r3, section_r3 = router_report(moe, native_rollouts, dtype=DTYPE, device="cpu",
                                           kernels="invariant", router_replay="R3",
                                           tolerance=Tolerance.exact())
    assert section_r3["replay"] == "R3" and summary_r3["router_agreement"] == 1.0


def test_router_report_on_the_reference_engine_with_r3_is_exact(invariant_rollouts, moe):
    summary, section = router_report(moe, invariant_rollouts, dtype=DTYPE, device="cpu",
                                     kernels="invariant", router_replay="R3", tolerance=Tolerance.exact())
    assert summary["router_agreement"] == 1.0 and summary["router_token_any_diff"] == 0.0
    assert section["sides"]["R3"]["drift"]["max_abs_logprob_diff"] == 0.0
    assert section["sides"]["none"]["drift"]["max_abs_logprob_diff"] == 0.0


# -- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cut, name", [(lambda r: r[:-1], "positions"), (lambda r: r[:, :1], "moe_layers"),
                                       (lambda r: r[..., :1], "top_k")])
def test_misshapen_routes_name_the_wrong_dimension(invariant_rollouts, moe, cut, name):
    given = [cut(ro.routed_experts) for ro in invariant_rollouts]
    with pytest.raises(InputError, match=rf"sequences\[0\].*\({name}\)"):
        train_forward(moe, invariant_rollouts, dtype=DTYPE, router_replay="R3", routes=given)


def test_routes_must_exist_and_fit_the_model(invariant_rollouts, moe):
    pairs = [(ro.prompt_ids, ro.token_ids) for ro in invariant_rollouts]
    with pytest.raises(InputError, match="no routed_experts"):
        train_forward(moe, pairs, dtype=DTYPE, router_replay="R3")
    with pytest.raises(InputError, match="expert id"):
        train_forward(moe, pairs, dtype=DTYPE, router_replay="R3",
                      routes=[ro.routed_experts + 8 for ro in invariant_rollouts])
    with pytest.raises(InputError, match="one per sequence"):
        train_forward(moe, pairs, dtype=DTYPE, router_replay="R3",
                      routes=[invariant_rollouts[0].routed_experts])
    with pytest.raises(ConfigError, match="only with router_replay='R3'"):
        train_forward(moe, pairs, dtype=DTYPE, routes=[ro.routed_experts for ro in invariant_rollouts])
    with pytest.raises(ConfigError, match="router_replay"):
        train_forward(moe, pairs, dtype=DTYPE, router_replay="R5")


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_dense_models_are_rejected(invariant_rollouts, mode):
    pairs = [(ro.prompt_ids, ro.token_ids) for ro in invariant_rollouts]
    routes = [ro.routed_experts for ro in invariant_rollouts] if mode == "R3" else None
    with pytest.raises(ConfigError, match="dense"):
        train_forward("tiny-qwen3", pairs, dtype=DTYPE, router_replay=mode, routes=routes)


# -- through compare and the CLI ------------------------------------------------------------------

PROMPTS = [r.prompt_ids for r in requests()]


@pytest.mark.slow
def test_compare_with_r3_on_the_reference_engine_is_exact():
    from parity.compare import compare

    report = compare("tiny-qwen3-moe", "reference", prompts=PROMPTS, sampling=SamplingParams(max_tokens=12),
                     dtype=DTYPE, router_replay="R3", record_routes=True)
    assert report.summary["router_agreement"] == 1.0 and report.summary["router_token_any_diff"] == 0.0
    assert report.summary["max_abs_logprob_diff"] == 0.0
    router = report.extras["router"]
    assert router["replay"] == "R3" and set(router["sides"]) == {"none", "R3"}
    assert type(report).from_json(report.to_json()).extras["router"] == router


@pytest.mark.slow
def test_compare_against_a_disagreeing_backend_shows_drift_with_and_without_replay():
    from parity.backends.reference import ReferenceBackend
    from parity.compare import compare

    with ReferenceBackend("tiny-mixtral", dtype=DTYPE, kernels="native", record_routes=True) as backend:
        report = compare("tiny-mixtral", backend, prompts=PROMPTS, sampling=SamplingParams(max_tokens=12),
                         dtype=DTYPE)
    assert 0 < report.summary["router_agreement"] < 1.0
    assert len(report.summary["router_agreement_per_layer"]) == 2
    sides = report.extras["router"]["sides"]
    assert sides["none"]["router_agreement"] == report.summary["router_agreement"]
    assert sides["R3"]["router_agreement"] == 1.0
    without, with_r3 = sides["none"]["drift"], sides["R3"]["drift"]
    assert without["max_abs_logprob_diff"] == report.summary["max_abs_logprob_diff"]
    assert with_r3["max_abs_logprob_diff"] < without["max_abs_logprob_diff"]  # measured 0.05 vs 0.42


@pytest.mark.slow
def test_cli_compare_router_replay_r3(capsys):
    from parity.cli import main

    case = Path(__file__).resolve().parent.parent / "cases" / "moe.toml"
    code = main(["compare", "--case", str(case), "--backend", "reference", "--router-replay", "R3",
                 "--option", "record_routes=true"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "router_agreement" in out and "router_token_any_diff" in out
