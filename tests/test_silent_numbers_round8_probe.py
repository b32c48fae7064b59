"""Round 8 of the silent-numbers review, the engine probe: rows of two sides aligned at the wrong
position, stages one side never captured, NaN growth, and options the probe ignored. No engine starts:
the vLLM worker extension runs on fake scheduler outputs, the comparison on fake probes."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from parity.attribute import probe as probe_module
from parity.attribute.layers import StageDiff
from parity.attribute.probe import EngineProbe, EngineSide, PhaseDiff, compare_probes, engine_diff
from parity.attribute.settings import Setting
from parity.backends.vllm_probe import PROBE_KEY, ProbeExtension, probe_engine_kwargs
from parity.core.errors import ConfigError, InputError, UnsupportedError
from parity.core.types import Request, SamplingParams

# --- the vLLM worker extension, on fake steps ---------------------------------------------------------


class FakeWorker(ProbeExtension):
    """The worker attributes the probe touches, its hooks called by hand step by step."""

    def __init__(self, req_ids):
        self.model_runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=req_ids))
        self._parity_hooks, self._parity_layers, self._parity_moe = [], [], []
        self.parity_probe_start(["embed", "logits"])
        self._embed = self._parity_hook("embed", "embed", 0)
        self._logits = self._parity_hook("logits", "logits", 0)
        self.steps = 0

    def step(self, counts, new=(), cached=(), resumed=()):
        """One forward: `counts` {req_id: tokens} in batch order; embed rows hold the step number and
        the token's position in the step, every request's logits row the step number."""
        cached = list(cached)
        scheduled = SimpleNamespace(
            num_scheduled_tokens=counts,
            scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=list(range(p)),
                                                num_computed_tokens=0,
                                                sampling_params=SimpleNamespace(extra_args={PROBE_KEY: k}))
                                for k, (r, p) in enumerate(new)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                                  num_computed_tokens=[c for _, c in cached],
                                                  resumed_req_ids=set(resumed)))
        self._parity_step = {"scheduled": scheduled, "rows": None}
        total = sum(counts.values())
        self._embed(None, None, torch.stack([torch.full((total,), float(self.steps)),
                                             torch.arange(total, dtype=torch.float32)], dim=1))
        self._logits(None, None, torch.full((len(counts), 3), float(self.steps)))
        self._parity_step = None
        self.steps += 1

    def taken(self, req_id):
        data = self._parity_data[req_id]
        return {name: torch.cat(parts) for name, parts in data.items()}


def test_a_chunked_prefill_keeps_one_logits_row_per_sampled_token():
    """A prompt of 10 prefilled in chunks of 6 and 4, then 2 decode steps: 3 tokens sampled, so 3
    logits rows (steps 1, 2, 3). The old probe kept the first chunk's row too, which the engine drops,
    so every logits row sat one position off."""
    worker = FakeWorker(["a"])
    worker.step({"a": 6}, new=[("a", 10)])
    worker.step({"a": 4}, cached=[("a", 6)])
    worker.step({"a": 1}, cached=[("a", 10)])
    worker.step({"a": 1}, cached=[("a", 11)])
    got = worker.taken("a")
    assert got["logits"][:, 0].tolist() == [1.0, 2.0, 3.0]
    assert got["embed"].shape[0] == 12  # 10 prompt rows and 2 decode rows: token rows were right


def test_a_request_among_others_keeps_its_own_logits_rows_in_chunks():
    """Two requests, the second chunked: the first's decode rows stay one per step."""
    worker = FakeWorker(["a", "b"])
    worker.step({"a": 3, "b": 2}, new=[("a", 3), ("b", 5)])
    worker.step({"a": 1, "b": 3}, cached=[("a", 3), ("b", 2)])
    assert worker.taken("a")["logits"][:, 0].tolist() == [0.0, 1.0]
    assert worker.taken("b")["logits"][:, 0].tolist() == [1.0]
    assert worker.taken("b")["embed"][:, 1].tolist() == [3.0, 4.0, 1.0, 2.0, 3.0]


def test_a_preempted_request_keeps_one_row_per_position():
    """Prompt 4, two tokens sampled, then preempted: it resumes from 0 and recomputes its 5 known tokens
    (prompt + the token fed back) plus samples its third. Its token rows must be positions 0..4 once
    (from the recompute), not 0..4 followed by 0..4 again (old: 10 rows, the later ones misaligned)."""
    worker = FakeWorker(["a"])
    worker.step({"a": 4}, new=[("a", 4)])
    worker.step({"a": 1}, cached=[("a", 4)])
    worker.step({"a": 6}, cached=[("a", 0)], resumed=["a"])
    got = worker.taken("a")
    assert got["embed"].shape[0] == 6
    assert got["embed"][:, 0].tolist() == [2.0] * 6  # all rows from the recompute
    assert got["logits"][:, 0].tolist() == [0.0, 1.0, 2.0]


def test_a_layer_output_is_never_read_from_a_norm_without_the_residual():
    """Layer i's output is the residual (item 1) the next fused add-RMSNorm returns; a norm called
    without the residual returns the normed tensor alone, which the old hook stored as layer i's output.
    Now the stage stays uncaptured (the comparison then names it missing)."""
    worker = FakeWorker(["a"])
    worker._parity_kinds = frozenset({"layer", "norm"})
    new = SimpleNamespace(req_id="a", prompt_token_ids=[1, 2], num_computed_tokens=0,
                          sampling_params=SimpleNamespace(extra_args={PROBE_KEY: 0}))
    scheduled = SimpleNamespace(num_scheduled_tokens={"a": 2}, scheduled_cached_reqs=None,
                                scheduled_new_reqs=[new])
    worker._parity_step = {"scheduled": scheduled, "rows": None}
    normed, residual = torch.zeros(2, 3), torch.ones(2, 3)
    worker._parity_hook("layer", "layer.0", 1)(None, None, normed)
    worker._parity_hook("layer", "layer.1", 1)(None, None, (normed, residual))
    worker._parity_hook("norm", "norm", 0)(None, None, (normed, residual))
    got = worker.taken("a")
    assert "layer.0" not in got
    assert torch.equal(got["layer.1"], residual) and torch.equal(got["norm"], normed)


def test_speculative_decoding_is_refused_by_the_probe():
    with pytest.raises(ConfigError, match="speculative"):
        probe_engine_kwargs({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
    assert probe_engine_kwargs({"speculative_config": None})["enforce_eager"] is True


# --- comparing two probes -----------------------------------------------------------------------------

def probe(label, states, prompt=(1, 2, 3), tokens=(7, 8, 9, 10)):
    return EngineProbe(label=label, states={0: states},
                       rollouts=(SimpleNamespace(prompt_ids=list(prompt), token_ids=list(tokens)),))


def stages(extra=()):
    """Prompt 3, 4 tokens: 6 fed rows, 4 logits rows."""
    gen = torch.Generator().manual_seed(0)
    out = {"embed": torch.randn(6, 4, generator=gen), "layer.0": torch.randn(6, 4, generator=gen),
           "logits": torch.randn(4, 5, generator=gen)}
    return {**out, **{name: torch.randn(6, 4, generator=gen) for name in extra}}


def test_a_stage_one_side_never_captured_is_refused():
    """Old: names came from side B alone, so side A's "layer.0.attn" was silently left out of the
    report (and a stage only B had raised a KeyError)."""
    with pytest.raises(UnsupportedError, match=r"side B lacks \['layer.0.attn'\]"):
        compare_probes("m", "vllm", probe("A", stages(["layer.0.attn"])), probe("B", stages()))
    with pytest.raises(UnsupportedError, match=r"side A lacks \['layer.0.attn'\]"):
        compare_probes("m", "vllm", probe("A", stages()), probe("B", stages(["layer.0.attn"])))
    same = compare_probes("m", "vllm", probe("A", stages()), probe("B", stages()))
    assert same.positions == {"prefill": 3, "decode": 3}


def test_an_incomplete_capture_is_refused_not_read_as_equal():
    """Side B holds only its prefill rows (its decode steps' hooks never ran): old, the decode phase
    compared 0 positions and read "first differing stage: none"."""
    short = {name: x[:1] if name == "logits" else x[:3] for name, x in stages().items()}
    with pytest.raises(UnsupportedError, match="side B captured 3 rows of the 6"):
        compare_probes("m", "vllm", probe("A", stages()), probe("B", short))


def test_rows_of_different_prompts_are_refused():
    """Old: sample 0 of two probes of different requests compared row by row, 'no difference'."""
    with pytest.raises(InputError, match="prompts differ"):
        compare_probes("m", "vllm", probe("A", stages(), prompt=(1, 2, 3)),
                       probe("B", stages(), prompt=(4, 5, 6)))


def test_growth_starts_at_the_first_differing_layer_even_when_it_is_nan():
    """layer.0 went NaN: old, growth skipped it and answered layer.2 / layer.1 = 100; an infinite
    first error answered None, which the report prints as "no layer output differs"."""
    def phase(first):
        return PhaseDiff("decode", (StageDiff("layer.0", first, first, 3, 10),
                                    StageDiff("layer.1", 1, 0.01, 3, 10),
                                    StageDiff("layer.2", 1, 1.0, 3, 10)))
    assert math.isnan(phase(math.nan).growth)
    assert phase(math.inf).growth is not None and math.isnan(phase(math.inf).growth)
    assert phase(0.5).growth == 2.0
    assert PhaseDiff("decode", (StageDiff("layer.0", 0, 0, 0, 10),)).growth is None


# --- engine_diff's options ------------------------------------------------------------------------------

class FakeEngine:
    name = "vllm"

    def probe(self, part, local, kinds):
        rollouts = [SimpleNamespace(prompt_ids=r.prompt_ids, token_ids=[1, 2, 3])
                    for r in part for _ in range(r.sampling.n)]
        return rollouts, {i: {"layer.0": torch.ones(len(rollouts[i].prompt_ids) + 2, 4)} for i in local}

    def close(self):
        pass


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.setattr(probe_module, "get_backend", lambda *args, **kwargs: FakeEngine())


def requests():
    sp = SamplingParams(temperature=1.0, max_tokens=3, seed=7, ignore_eos=True)
    return [Request(request_id=f"r{i}", prompt_ids=[3 + i + j for j in range(5 + 3 * i)], sampling=sp)
            for i in range(3)]


def test_train_with_an_engine_side_a_is_refused(fake_engine):
    """Old: train=Setting(dtype='float32') with against= was silently ignored."""
    with pytest.raises(ConfigError, match="train would be ignored"):
        engine_diff("tiny-llama", requests(), against=EngineSide(batch=1), train=Setting(dtype="float32"),
                    stages="layer")
    diff = engine_diff("tiny-llama", requests(), against=EngineSide(batch=1), stages="layer")
    assert diff.side_a == "vllm: 1 request(s) per call"


@pytest.mark.parametrize("capture", [[1.9], "12", [True]])
def test_capture_must_be_integer_indices(fake_engine, capture):
    """Old: [1.9] captured sample 1, "12" samples 1 and 2, [True] sample 1."""
    with pytest.raises(InputError, match="capture must be sample indices"):
        engine_diff("tiny-llama", requests(), against=EngineSide(batch=1), capture=capture, stages="layer")


def test_numpy_integer_capture_still_works(fake_engine):
    diff = engine_diff("tiny-llama", requests(), against=EngineSide(batch=1), capture=np.array([2, 0]),
                       stages="layer")
    assert diff.sequences == (0, 2)


def test_the_command_versus_batch_still_runs(fake_engine, capsys):
    """The command gave train= on every run; now only with --versus train (else refused)."""
    from parity.attribute.command import main
    assert main(["--model", "tiny-llama", "--backend", "vllm", "--versus", "batch", "--stages", "layer",
                 "--max-sequences", "2"]) == 0
    assert "1 request(s) per call" in capsys.readouterr().out


def _engine_diff(positions: dict[str, int], first: str | None, growth: float | None) -> dict:
    phases = [{"phase": name, "first_differing": first, "growth": growth, "stages": [], "depth": []}
              for name in positions]
    return {"side_a": "train", "side_b": "vllm", "sequences": [], "parted": 0, "positions": positions,
            "phases": phases}


def test_a_phase_of_no_position_is_not_shown_as_bitwise_equal():
    from parity.render.attribution import engine_html, engine_text

    diff = _engine_diff({"prefill": 0, "decode": 4}, None, None)
    text, page = engine_text(diff), engine_html(diff)
    assert "prefill (0 positions): first differing stage none (no position compared)" in text
    assert "decode (4 positions): first differing stage none (bitwise equal everywhere)" in text
    assert "none (no position compared)" in page and "none (bitwise equal everywhere)" in page


def test_a_growth_that_is_not_finite_is_said_in_words():
    from parity.render.attribution import engine_text

    text = engine_text(_engine_diff({"decode": 4}, "layer.0", float("nan")))
    assert "not finite at the first differing layer" in text and "nan" not in text.lower()
