"""Round 9 of the silent-numbers review, numbers written to files and read back at their non-finite
edges: the RL loop's record (an infinite KL stored as null read back as "not measured"), its page, and
the engine probe's JSON (bare NaN / Infinity, which jq reads as null and 1.8e308). No engine starts."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from parity.core.errors import InputError
from parity.loop.record import STEP_EXTRA_KEYS, STEP_KEYS, LoopRecord

INF, NAN = math.inf, math.nan
#: the row key naming a row's non-finite floats (`parity.core.tables.NONFINITE_KEY`): part of the format.
NONFINITE_KEY = "nonfinite"


def _strict(text: str) -> object:
    """json.loads that refuses NaN / Infinity / -Infinity, as jq-compatible and JavaScript readers do."""
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def _row(step: int, drift: float, k3: float, ratio: float = 1.0) -> dict:
    row = dict.fromkeys((*STEP_KEYS, *STEP_EXTRA_KEYS), None)
    row.update(step=step, backend="vllm", max_abs_logprob_diff=drift, mean_abs_logprob_diff=drift / 10,
               k3_kl=k3, is_ratio_mean=ratio, reward_mean=0.5, policy_kl_from_start=0.0, weights_in_sync=True,
               seconds=0.1, is_ratio_min=1.0, is_ratio_max=ratio, clip_fraction=0.0, bitwise=False,
               num_tokens=4, trained_on=True, sync_hidden=0)
    return row


def _record(steps: list[dict], updates: list[dict] | None = None) -> LoopRecord:
    return LoopRecord(model="tiny-llama", backends=["vllm"], seed=0, train_on="vllm", config={},
                      provenance={}, steps=steps, updates=updates or [], status="complete")


# -- the loop record --------------------------------------------------------------------------------


def test_an_infinite_kl_reads_back_as_infinite_not_as_unmeasured():
    """Old: +inf and NaN were both written as null, so the step read back as "no value" (None)."""
    record = _record([_row(0, 0.01, 1e-5), _row(1, INF, INF, NAN)],
                     [{"step": 0, "loss": NAN, "grad_norm": INF, "forward_bitwise": True, "kept_tokens": 4,
                       "seconds": 0.1}])
    text = record.to_json()
    stored = _strict(text)  # strict JSON still: no bare NaN / Infinity
    back = LoopRecord.from_dict(stored)
    assert back.steps[1]["k3_kl"] == INF and back.steps[1]["max_abs_logprob_diff"] == INF
    assert math.isnan(back.steps[1]["is_ratio_max"]) and math.isnan(back.steps[1]["is_ratio_mean"])
    assert math.isnan(back.updates[0]["loss"]) and back.updates[0]["grad_norm"] == INF
    assert NONFINITE_KEY not in back.steps[1]  # in memory, a row is the loop's row again
    assert back.to_json() == text  # and writes the same file


def test_a_reader_that_predates_the_marker_still_sees_null():
    """New files in old code: the value is null as before, the marker an extra key beside it."""
    stored = _strict(_record([_row(0, 0.01, INF)]).to_json())
    row = stored["steps"][0]
    assert row["k3_kl"] is None and row[NONFINITE_KEY] == {"k3_kl": "inf"}
    assert list(row)[:len(STEP_KEYS)] == list(STEP_KEYS)


def test_old_files_still_load_and_finite_rows_are_written_as_before():
    old = {"model": "m", "backends": ["vllm"], "seed": 0, "steps": [_row(0, 0.01, 1e-5)],
           "updates": [{"step": 0, "loss": None, "grad_norm": 1.0}]}
    old["steps"][0]["k3_kl"] = None  # an old file: null for an infinite or NaN value alike
    back = LoopRecord.from_dict(json.loads(json.dumps(old)))
    assert back.steps[0]["k3_kl"] is None and back.updates[0]["loss"] is None
    clean = _record([_row(0, 0.01, 1e-5)]).to_dict()
    assert set(clean["steps"][0]) == {*STEP_KEYS, *STEP_EXTRA_KEYS}  # no marker where all is finite


@pytest.mark.parametrize("marker", [{"k3_kl": "big"}, {"k3_kl": INF}, ["k3_kl"], {"reward_mean": "inf"},
                                    {"no_such_field": "nan"}])
def test_a_marker_that_contradicts_its_row_is_refused(marker):
    """A marker naming a value that is not null, an unknown spelling or a missing field: which number is
    meant cannot be told (old code had no marker: it would have kept whichever)."""
    row = {**_row(0, 0.01, None), NONFINITE_KEY: marker}
    document = {"model": "m", "backends": ["vllm"], "seed": 0, "steps": [row]}
    with pytest.raises(InputError, match=r"steps\[0\].*'nonfinite'"):
        LoopRecord.from_dict(json.loads(json.dumps(document)))


def test_the_marker_keeps_every_spelling():
    from parity.core.tables import NONFINITE_KEY as key
    from parity.core.tables import nonfinite_as_null, nonfinite_restored

    assert key == NONFINITE_KEY
    row = {"a": -INF, "b": INF, "c": NAN, "d": 1.5, "e": None, "f": "inf"}
    stored = nonfinite_as_null(row)
    assert stored == {"a": None, "b": None, "c": None, "d": 1.5, "e": None, "f": "inf",
                      NONFINITE_KEY: {"a": "-inf", "b": "inf", "c": "nan"}}
    back = nonfinite_restored(json.loads(json.dumps(stored)), "here")
    assert back["a"] == -INF and back["b"] == INF and math.isnan(back["c"]) and back["f"] == "inf"
    assert back["e"] is None and list(back) == list(row)


# -- the loop page --------------------------------------------------------------------------------


def test_the_loop_page_shows_an_infinite_step_as_inf_not_the_finite_max():
    """Old: the page (drawn from the record's JSON) showed 0.01 under "max |Δlogp| (all steps)" and 1e-05
    under "k3 KL (max)" for a run whose second step was infinite."""
    from parity.render.loop import backend_summary, loop_page

    document = _record([_row(0, 0.01, 1e-5), _row(1, INF, INF)]).to_dict()
    summary = backend_summary(document["steps"])
    assert summary["max_abs_logprob_diff"] == INF and summary["k3_kl"] == INF
    page = loop_page(document)
    assert '<td class="bad">inf (1 of 2 steps with no finite value)</td>' in page
    assert "0.01 (1 of 2" not in page


# -- the engine probe's JSON ----------------------------------------------------------------------------


class _NonFiniteEngine:
    """All requests in one call give layer.0 a NaN and layer.1 an inf; one request per call, ones."""

    name = "vllm"

    def probe(self, part, local, kinds):
        rollouts = [SimpleNamespace(prompt_ids=r.prompt_ids, token_ids=[1, 2, 3])
                    for r in part for _ in range(r.sampling.n)]

        def states(i):
            rows = len(rollouts[i].prompt_ids) + 2
            x, y = torch.ones(rows, 4), torch.ones(rows, 4)
            if len(part) > 1:
                x[0, 0], y[1, 1] = NAN, INF
            return {"layer.0": x, "layer.1": y}
        return rollouts, {i: states(i) for i in local}

    def close(self):
        pass


def test_the_engine_probe_json_is_strict_and_a_nan_growth_is_not_null(monkeypatch, tmp_path):
    """Old: `"growth": NaN` and `"rel_error": Infinity`; jq reads them as null (which the file uses for
    "no layer output differs") and 1.7976931348623157e+308, JavaScript refuses the file."""
    from parity.attribute import probe as probe_module
    from parity.attribute.command import main
    from parity.core.schema import json_float

    monkeypatch.setattr(probe_module, "get_backend", lambda *args, **kwargs: _NonFiniteEngine())
    out = tmp_path / "engine.json"
    assert main(["--model", "tiny-llama", "--backend", "vllm", "--versus", "batch", "--stages", "layer",
                 "--max-sequences", "2", "--json", str(out)]) == 0
    prefill, decode = _strict(out.read_text())["engine"]["phases"]
    assert prefill["growth"] == "nan" and decode["growth"] is None  # told apart
    assert [s["rel_error"] for s in prefill["stages"]] == ["nan", "inf"]
    assert json_float(prefill["stages"][1]["rel_error"]) == INF  # the documented way back


def test_the_attribution_json_is_strict(monkeypatch, tmp_path):
    """The ablation and layer probe's file too: a stage whose A side is all zero has rel_error inf."""
    from parity.attribute import command, section

    stage = {"stage": "embed", "max_abs": 1.0, "rel_error": INF, "differing": 1, "elements": 4}
    layers = {"setting_a": {"label": "a"}, "setting_b": {"label": "b"}, "stages": [stage],
              "first_differing": "embed"}
    monkeypatch.setattr(command, "_sequences", lambda *args: ("tiny-llama", "float32", []))
    monkeypatch.setattr(section, "attribution_section", lambda *args, **kwargs: {
        "axes": [{"axis": "batch", "description": "d", "layers": layers}]})
    out = tmp_path / "a.json"
    assert command.main(["--model", "tiny-llama", "--no-ops", "--json", str(out)]) == 0
    assert _strict(out.read_text())["axes"][0]["layers"]["stages"][0]["rel_error"] == "inf"


def test_a_growth_that_is_infinite_at_the_last_layer_does_not_blame_the_first():
    """Old: layer.0 differed by 1e-3, the last layer's error was inf, and the page said the error was
    "not finite at the first differing layer"."""
    from parity.attribute.layers import StageDiff
    from parity.attribute.probe import PhaseDiff
    from parity.render.attribution import engine_text

    def text(first: float, last: float) -> str:
        phase = PhaseDiff("decode", (StageDiff("layer.0", first, first, 3, 10),
                                     StageDiff("layer.1", last, last, 3, 10))).to_dict()
        return engine_text({"side_a": "a", "side_b": "b", "sequences": [0], "parted": 0,
                            "positions": {"decode": 4}, "phases": [phase]})

    assert "not finite at the last layer (inf), from 0.001 at the first differing layer" in text(1e-3, INF)
    assert "not finite at the first differing layer" not in text(1e-3, INF)
    assert "not finite at the first differing layer (no growth ratio)" in text(NAN, 1.0)
    assert "x1e+03 from the first differing layer" in text(1e-3, 1.0)
