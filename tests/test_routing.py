"""The router patch point and route arrays: `parity.models.routing` and `parity.drift.routes`, no full
model."""

import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.core.errors import ConfigError, InputError, ParityError
from parity.drift.routes import as_routes, check_routes, router_agreement
from parity.kernels.switch import invariant
from parity.models import routing


def make_router(kind: str, hidden: int = 16, experts: int = 8, top_k: int = 2, seed: int = 0,
                weight: torch.Tensor | None = None) -> torch.nn.Module:
    """A HF router module with random weights, patched as moe layer 0 (its stock forward kept as .stock)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "qwen3":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as cls

        config = Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                                norm_topk_prob=True)
    elif kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as cls

        config = MixtralConfig(hidden_size=hidden, num_local_experts=experts, num_experts_per_tok=top_k)
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as cls

        config = DeepseekV3Config(hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=top_k,
                                  n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = cls(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) if weight is None else weight)
        if kind == "deepseek":
            router.e_score_correction_bias.copy_(torch.rand(experts, generator=gen) * 0.1)
    router.stock = types.MethodType(cls.forward, router)
    routing.patch_router(router, 0)
    return router


KINDS = ["qwen3", "mixtral", "deepseek"]


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) with each row's slots sorted by expert id (DeepSeek's HF top-k is unsorted)."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def hidden_rows(n: int = 37, h: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, h, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_route_with_kernels_off_is_the_stock_router_bit_for_bit(kind):
    router = make_router(kind)
    x = hidden_rows()
    (logits, weights, ids), (stock_logits, stock_weights, stock_ids) = router(x), router.stock(x)
    assert torch.equal(logits, stock_logits)
    if kind == "deepseek":  # HF picks with topk(sorted=False): same set, slot order unspecified
        weights, ids = by_expert(weights, ids)
        stock_weights, stock_ids = by_expert(stock_weights, stock_ids)
    assert torch.equal(ids, stock_ids) and torch.equal(weights, stock_weights)


def test_unknown_router_class_is_refused():
    with pytest.raises(ConfigError, match="not supported"):
        routing.patch_router(torch.nn.Linear(2, 2), 0)


@pytest.mark.parametrize("kind", KINDS)
def test_capture_records_ids_and_weights_in_forward_order(kind):
    router = make_router(kind)
    x = hidden_rows()
    with routing.capture(1) as rec:
        _, w1, i1 = router(x[:20])
        _, w2, i2 = router(x[20:])
    assert rec.routes().dtype == torch.int32 and rec.routes().shape == (37, 1, 2)
    assert torch.equal(rec.routes()[:, 0], torch.cat([i1, i2]).to(torch.int32))
    assert torch.equal(rec.weights()[:, 0], torch.cat([w1, w2]).float())


@pytest.mark.parametrize("kernels", ["native", "invariant"])
@pytest.mark.parametrize("kind", KINDS)
def test_forcing_the_routers_own_choice_changes_no_bit(kind, kernels):
    """Exactness of replay itself: R3 of identical routes must be the identity, zero tolerance."""
    router = make_router(kind)
    x = hidden_rows()
    with invariant(families=set() if kernels == "native" else None):
        _, weights, ids = router(x)
        forced = routing.ForcedRoutes(ids[:, None].clone(), torch.ones(len(x), dtype=torch.bool))
        with routing.forcing(forced):
            _, fw, fi = router(x)
    assert torch.equal(fi, ids) and torch.equal(fw, weights)


@pytest.mark.parametrize("kind", KINDS)
def test_forced_experts_get_the_training_routers_renormalized_scores(kind):
    router = make_router(kind)
    x = hidden_rows()
    logits, weights, ids = router(x)
    scores = torch.sigmoid(logits) if kind == "deepseek" else torch.softmax(logits.float(), dim=-1)
    other = (ids + 3) % 8  # a different expert set for every row: the negative control
    mask = torch.arange(len(x)) % 2 == 0  # odd rows route freely
    with routing.forcing(routing.ForcedRoutes(other[:, None].clone(), mask)):
        _, fw, fi = router(x)
    assert torch.equal(fi[mask].sort(-1).values, other[mask].sort(-1).values)
    assert torch.equal(fi[~mask], ids[~mask]) and torch.equal(fw[~mask], weights[~mask])
    picked = scores[mask].gather(1, fi[mask])
    scale = 2.5 if kind == "deepseek" else 1.0
    torch.testing.assert_close(fw[mask].float(), picked / picked.sum(-1, keepdim=True) * scale)
    assert not torch.equal(fw[mask], weights[mask])


def test_forcing_weights_replays_them_exactly():
    router = make_router("qwen3")
    x = hidden_rows()
    _, _, ids = router(x)
    recorded = torch.rand(len(x), 1, 2)
    with routing.forcing(routing.ForcedRoutes(ids[:, None].clone(), torch.ones(len(x), dtype=torch.bool),
                                              recorded)):
        _, fw, fi = router(x)
    assert torch.equal(fi, ids) and torch.equal(fw, recorded[:, 0])


def test_forcing_with_the_wrong_token_count_is_an_error():
    router = make_router("qwen3")
    forced = routing.ForcedRoutes(torch.zeros(5, 1, 2, dtype=torch.int64), torch.ones(5, dtype=torch.bool))
    with routing.forcing(forced), pytest.raises(InputError, match="5 tokens"):
        router(hidden_rows(7))


@settings(max_examples=10)
@given(st.lists(st.integers(0, 2), min_size=8, max_size=8), st.sampled_from(KINDS), st.booleans())
def test_tied_scores_forced_choice_is_identity(levels, kind, on):
    """Experts sharing router rows score exactly alike; forcing the router's own pick still changes no bit."""
    base = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    router = make_router(kind, weight=base[levels])
    x = hidden_rows()
    with invariant(families=None if on else ()):
        _, weights, ids = router(x)
        everything = torch.ones(len(x), dtype=torch.bool)
        with routing.forcing(routing.ForcedRoutes(ids[:, None].clone(), everything)):
            _, fw, fi = router(x)
    assert torch.equal(fi, ids) and torch.equal(fw, weights)


def test_router_replay_settings_are_validated():
    assert routing.RouterReplay.of(None) is None and routing.RouterReplay.of("none") is None
    assert routing.RouterReplay.of("R3") == routing.RouterReplay("R3", "recompute")
    assert routing.RouterReplay.of("R2").mode == "R2"
    assert routing.RouterReplay("R2", "replay").weights == "replay"
    for bad in ("r3", "R4", 3):
        with pytest.raises(ConfigError, match="router_replay"):
            routing.RouterReplay.of(bad)
    with pytest.raises(ConfigError, match="mode"):
        routing.RouterReplay("R1")
    with pytest.raises(ConfigError, match="weights"):
        routing.RouterReplay("R2", "copy")
    with pytest.raises(ConfigError, match="expert ids only"):
        routing.RouterReplay("R3", "replay")


# -- route arrays -----------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda a: a.astype(np.int64), lambda a: a.astype(np.uint8), lambda a: a.astype(np.int16),
    lambda a: torch.from_numpy(a.astype(np.int64)), lambda a: a.tolist(),
])
def test_route_dtypes_are_normalized_to_int32(make):
    base = np.arange(24).reshape(4, 3, 2) % 8
    out = as_routes(make(base))
    assert out.dtype == np.int32 and np.array_equal(out, base)


@pytest.mark.parametrize("bad, match", [
    (np.zeros((4, 3, 2), np.float32), "integer"), (np.zeros((4, 6), np.int32), "3 dimensions"),
    (np.full((1, 1, 1), -1), "outside"), (np.full((1, 1, 1), 2**40), "outside"),
])
def test_bad_route_arrays_are_rejected(bad, match):
    with pytest.raises(InputError, match=match):
        as_routes(bad)


@pytest.mark.parametrize("shape, name", [((9, 2, 2), "positions"), ((10, 3, 2), "moe_layers"),
                                         ((10, 2, 4), "top_k")])
def test_check_routes_names_the_wrong_dimension(shape, name):
    with pytest.raises(ParityError, match=rf"\({name}\)"):
        check_routes(np.zeros(shape, np.int32), positions=10, moe_layers=2, top_k=2, num_experts=8)
    distinct = np.tile(np.arange(2, dtype=np.int64), (10, 2, 1))  # each row two different experts
    assert check_routes(distinct, positions=10, moe_layers=2, top_k=2, num_experts=8).dtype == np.int32


def test_check_routes_rejects_out_of_range_experts_and_dense_models():
    with pytest.raises(InputError, match="expert id 8"):
        check_routes(np.full((3, 1, 2), 8), positions=3, moe_layers=1, top_k=2, num_experts=8)
    with pytest.raises(InputError, match="dense"):
        check_routes(np.zeros((3, 1, 2), np.int32), positions=3, moe_layers=0, top_k=0, num_experts=0)


def test_router_agreement_counts_sets_positions_and_layers():
    a = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]])  # 3 positions, 2 layers
    b = a.copy()
    b[0, 0] = [1, 0]  # same set, other order: agrees
    b[1, 1] = [6, 5]  # differs in layer 1
    b[2] = [[0, 3], [1, 2]]  # differs in both layers
    out = router_agreement([a, a[:1]], [b, a[:1]])
    assert out == {"router_agreement": 5 / 8, "router_token_any_diff": 2 / 4,
                   "router_agreement_per_layer": [3 / 4, 2 / 4], "num_router_positions": 4}
    assert router_agreement([a], [a])["router_agreement"] == 1.0
    with pytest.raises(InputError, match="cannot be compared"):
        router_agreement([a], [a[:2]])
    with pytest.raises(InputError, match="one per sequence"):
        router_agreement([a], [])
