"""The backend contract without engines: registry, translation helpers, processed conversion."""

import dataclasses
import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parity.backends import (
    BACKENDS,
    available_backends,
    backend_options,
    get_backend,
    parse_option,
    shared_backend,
)
from parity.backends.base import (
    Backend,
    eos_token_ids,
    expand_samples,
    finish_reason,
    processed_from_raw,
    sample_seed,
    score_sampling,
    stop_set,
)
from parity.core.backend_table import BACKEND_TABLE, KINDS, PLACEMENTS
from parity.core.errors import BackendUnavailableError, ConfigError, InputError
from parity.core.schema import BACKEND_NAMES
from parity.core.types import Request, Rollout, SamplingParams, as_pairs
from parity.models import resolve_model


def test_registry_names_and_unknown_name():
    assert list(BACKENDS) == [spec.name for spec in BACKEND_TABLE]
    with pytest.raises(ConfigError, match=", ".join(BACKEND_NAMES)):
        get_backend("vllm-gpu", "tiny-llama")


def test_backend_table_rows_are_checked_data():
    """The table is data: a row with an unknown kind, placement or adapter spelling is refused."""
    assert {spec.kind for spec in BACKEND_TABLE} <= set(KINDS)
    assert {spec.runs_on for spec in BACKEND_TABLE} <= set(PLACEMENTS)
    row = BACKEND_TABLE[0]
    for bad in ({"kind": "cloud"}, {"runs_on": "tpu"}, {"adapter": "parity.backends.reference"}):
        with pytest.raises(ValueError, match="backend table row"):
            dataclasses.replace(row, **bad)


def test_registry_adapters_carry_the_schema_names():
    """One spelling of each backend name: the schema's, the registry's key and the adapter's `name`."""
    assert tuple(BACKENDS) == BACKEND_NAMES
    for name, spec in BACKENDS.items():
        module, cls = spec.adapter.split(":")
        assert spec.name == name and getattr(importlib.import_module(module), cls).name == name


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_unknown_option_is_a_config_error_listing_the_valid_ones(name):
    """Checked against the adapter's own parameters before any engine package is looked for, so
    even a backend not installed here (sglang, trtllm) answers with its options, not a TypeError."""
    valid = backend_options(name)
    assert valid and "dtype" not in valid and "model" not in valid
    with pytest.raises(ConfigError, match=f"backend '{name}' has no option 'batch_sise'") as info:
        get_backend(name, "tiny-llama", batch_sise=4)
    assert all(option in str(info.value) for option in valid)


def test_option_text_is_json_when_it_parses():
    assert parse_option("record_routes=true") == ("record_routes", True)
    assert parse_option("engine_kwargs={\"max_model_len\": 512}") == ("engine_kwargs", {"max_model_len": 512})
    assert parse_option("attn_implementation=eager") == ("attn_implementation", "eager")
    for bad in ("record_routes", "=1", "two words=1"):
        with pytest.raises(ConfigError, match="expected KEY=VALUE"):
            parse_option(bad)


def test_missing_package_names_the_extra():
    reasons = available_backends()
    assert set(reasons) == set(BACKENDS)
    assert reasons["hf"] is None
    for name, extra in [("sglang", "parity-harness[sglang]"), ("trtllm", "parity-harness[trtllm]")]:
        if reasons[name] is None:
            continue  # installed here: nothing to refuse
        assert extra in reasons[name]
        with pytest.raises(BackendUnavailableError, match=extra.replace("[", r"\[")):
            get_backend(name, "tiny-llama")


def test_shared_backend_is_cached_per_arguments():
    a = shared_backend("hf", "tiny-llama", dtype="float32", batch_size=4)
    assert shared_backend("hf", "tiny-llama", dtype="float32", batch_size=4) is a
    assert shared_backend("hf", "tiny-llama", dtype="float32", batch_size=2) is not a


def test_bad_dtype_and_options_are_config_errors():
    with pytest.raises(ConfigError, match="dtype"):
        get_backend("hf", "tiny-llama", dtype="fp8")
    with pytest.raises(ConfigError, match="batch_size"):
        get_backend("hf", "tiny-llama", batch_size=0)


@given(st.integers(0, 2**31), st.integers(0, 64))
def test_sample_seeds_are_stable_distinct_and_in_range(seed, index):
    s = sample_seed(seed, index)
    assert s == sample_seed(seed, index) and 0 <= s < 2**31
    assert s != sample_seed(seed, index + 1)
    assert sample_seed(seed, 1) != sample_seed(seed + 1, 0)  # seed + i would collide here


def test_expand_samples_orders_by_request_then_sample():
    reqs = [Request((1, 2), SamplingParams(n=3, seed=5), "a"), Request((1, 3), SamplingParams(n=1), "b")]
    jobs = expand_samples(reqs)
    assert [(j.request.request_id, j.sample_index) for j in jobs] == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    assert len({j.seed for j in jobs[:3]}) == 3
    with pytest.raises(InputError, match="unique"):
        expand_samples([reqs[0], reqs[0]])


def test_stop_set_eos_and_ignore_eos():
    eos = eos_token_ids(resolve_model("tiny-llama"))
    assert eos == (2,)
    sp = SamplingParams(stop_token_ids=(7, 9))
    assert stop_set(sp, eos) == (7, 9, 2)
    assert stop_set(sp.replace(ignore_eos=True), eos) == (7, 9)  # EOS skipped, stop ids kept
    assert finish_reason([5, 9], (7, 9, 2)) == "stop"
    assert finish_reason([5, 6], (7, 9, 2)) == "length"


class Stamping(Backend):
    """The smallest adapter: what every adapter's rollouts go through, without an engine."""

    name = "stamping"

    def generate(self, requests):
        return [self.finished(job, [5, 2], [-0.5, -0.25]) for job in expand_samples(requests)]

    def _score(self, pairs, sampling):
        raise NotImplementedError

    def close(self):
        pass


def test_every_adapter_stamps_the_requests_sampling():
    """`Backend.finished`, which every adapter builds its rollouts with, records the sampling the
    rollout was drawn with (TRT-LLM's adapter, which cannot run here, included)."""
    sampling = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, seed=3)
    rollouts = Stamping("tiny-llama").generate([Request((1, 2), sampling, "a")])
    assert [r.sampling for r in rollouts] == [sampling, sampling] and rollouts[0].finish_reason == "stop"
    assert Rollout.from_dict(rollouts[0].to_dict()) == rollouts[0]
    with pytest.raises(InputError, match="logprobs_mode 'raw' but its sampling says 'processed'"):
        Rollout("x", 0, (1,), (3,), (-0.5,), "length", "hf", logprobs_mode="raw", sampling=sampling)


def test_score_input_validation():
    r = Rollout("x", 0, (1, 2), (3,), (-0.5,), "length", "hf")
    assert as_pairs([r, ([1], [4, 5])]) == [((1, 2), (3,)), ((1,), (4, 5))]
    with pytest.raises(InputError, match=r"sequences\[0\]"):
        as_pairs([[1, 2, 3]])
    with pytest.raises(InputError, match="prompt_ids is empty"):
        as_pairs([([], [1])])
    with pytest.raises(InputError, match="negative token id"):
        as_pairs([([1], [-4])])
    with pytest.raises(InputError, match="must be a list"):
        as_pairs("1 2 3")
    assert as_pairs([]) == []
    with pytest.raises(ConfigError, match="logprobs_mode"):
        score_sampling("sampled", 1.0, 0, 1.0)
    with pytest.raises(ConfigError, match="top_p"):
        score_sampling("processed", 1.0, 0, 0.0)
    assert score_sampling("processed", 0.7, 5, 0.9) == SamplingParams(temperature=0.7, top_k=5, top_p=0.9)


@given(st.floats(0.3, 2.0), st.integers(0, 40), st.floats(0.05, 1.0), st.integers(0, 1000))
def test_processed_from_raw_is_a_truncated_tempered_distribution(temperature, top_k, top_p, seed):
    raw = torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)) * 3
    lp = processed_from_raw(raw.log_softmax(-1), temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.allclose(lp.exp().sum(-1), torch.ones(3), atol=1e-5)
    kept = torch.isfinite(lp)
    if top_k:
        assert bool((kept.sum(-1) <= top_k).all())
    assert bool(kept.gather(1, raw.argmax(-1, keepdim=True)).all())  # the argmax always survives
    # on the kept set of each row, processed = raw / T - log Z_row
    ref = raw / temperature
    for row in range(3):
        diff = (lp - ref)[row][kept[row]]
        assert float(diff.max() - diff.min()) < 1e-4 * max(1.0, float(ref.abs().max()))
