"""Drift attribution: settings, the runner's row bookkeeping, op ablation, layer probe, rendering, CLI.

Exactness claims are checked with zero tolerance, and each has a negative control: the same
comparison with one deliberately batch-variant op (injected by the test) must come out nonzero.
"""

import json
import random
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity import kernels
from parity.attribute import (
    AXES,
    Drift,
    Setting,
    attribute_ops,
    attribution_section,
    axis_settings,
    layer_diff,
    main,
)
from parity.attribute.runner import run, stage_names
from parity.core.errors import ConfigError, InputError
from parity.engine import LAYOUTS, train_forward
from parity.kernels import ops
from parity.models.loading import load_model
from parity.render.attribution import layers_text, ops_text, section_html

MODELS = ["tiny-llama", "tiny-qwen3-moe"]
#: multiplies the output of an injected batch-variant op when it runs batched: large enough to
#: dwarf any real single-thread drift, small enough to keep logits finite.
PERTURBATION = 1.0 + 2.0 ** -6


def _pairs(seed: int, count: int = 3, max_prompt: int = 12, max_response: int = 6):
    rng = random.Random(seed)
    return [(tuple(rng.randrange(3, 259) for _ in range(rng.randint(1, max_prompt))),
             tuple(rng.randrange(3, 259) for _ in range(rng.randint(1, max_response))))
            for _ in range(count)]


@contextmanager
def _hook(module, fn):
    handle = module.register_forward_hook(fn)
    try:
        yield
    finally:
        handle.remove()


def _batched(output: torch.Tensor) -> bool:
    """True when a [B, L, H] activation holds more than one sequence row (the variant side of "batch")."""
    return output.dim() == 3 and output.shape[0] > 1


def _variant_native_rms_norm(monkeypatch):
    """Make stock (family off) RMSNorm batch-variant: its output is scaled when it runs batched."""
    original = ops.rms_norm

    def rms_norm(x, weight, eps, native):
        out = original(x, weight, eps, native)
        if "rmsnorm" not in kernels.enabled_families() and _batched(out):
            out = out * PERTURBATION
        return out

    monkeypatch.setattr(ops, "rms_norm", rms_norm)


# -------------------------------------------------------------------------------------------
# Settings


def test_setting_normalizes_kernels_and_labels():
    assert Setting().kernels == frozenset(kernels.FAMILIES)
    assert Setting(kernels="native").kernels == frozenset()
    s = Setting(kernels=["rmsnorm", "matmul"], micro_batch_size=1)
    assert s.kernels == frozenset({"matmul", "rmsnorm"})
    assert s.kernels_label == "matmul+rmsnorm"
    assert "batch 1" in s.label and "matmul+rmsnorm kernels" in s.label
    assert s.with_kernels("invariant").kernels_label == "invariant"
    assert json.loads(json.dumps(s.to_dict()))["kernels"] == ["matmul", "rmsnorm"]


@pytest.mark.parametrize("field, value, needle", [
    ("dtype", "fp8", "setting.dtype"),
    ("micro_batch_size", 0, "setting.micro_batch_size"),
    ("micro_batch_size", True, "setting.micro_batch_size"),
    ("layout", "diagonal", "setting.layout"),
    ("mode", "chunked", "setting.mode"),
    ("kernels", ["matmul", "warp"], "unknown families"),
    ("kernels", "fast", "kernels must be"),
    ("device", "", "setting.device"),
])
def test_setting_rejects_bad_fields(field, value, needle):
    with pytest.raises(ConfigError, match=needle):
        Setting(**{field: value})


def test_decode_requires_packed_layout():
    with pytest.raises(ConfigError, match="layout must be 'packed' with mode='decode'"):
        Setting(mode="decode")
    Setting(mode="decode", layout="packed")


def test_axes_change_exactly_one_thing():
    for axis in AXES:
        a, b = axis_settings(axis, dtype="float32")
        differing = {k for k, v in a.to_dict().items() if b.to_dict()[k] != v} - {"label"}
        assert len(differing) == 1, (axis, differing)
    with pytest.raises(ConfigError, match="axis must be one of"):
        axis_settings("threads")


# -------------------------------------------------------------------------------------------
# Runner: captured rows land at the right (sequence, position)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.slow
def test_prefill_run_is_the_training_forward(model):
    pairs = _pairs(1)
    setting = Setting(kernels="native", micro_batch_size=2, layout="left")
    got = run(model, pairs, setting, capture=True)
    want = train_forward(model, pairs, kernels="native", micro_batch_size=2, layout="left",
                         logprobs_mode="raw").logprobs
    for g, w in zip(got.logprobs, want):
        assert torch.equal(g, w)
    assert list(got.states) == stage_names(load_model(model))
    # the captured logits are the rows the logprobs were read from (stock log_softmax, native kernels)
    for logits, lp, (_, response) in zip(got.states["logits"], got.logprobs, pairs):
        picked = torch.log_softmax(logits.float(), -1)[torch.arange(len(response)), list(response)]
        assert torch.equal(picked, lp)


@settings(max_examples=4)
@given(seed=st.integers(0, 2 ** 16), layout=st.sampled_from(LAYOUTS), size=st.integers(1, 3),
       mode=st.sampled_from(["prefill", "decode"]))
@pytest.mark.slow
def test_invariant_states_do_not_depend_on_batch_layout_or_mode(seed, layout, size, mode):
    pairs = _pairs(seed)
    alone = run("tiny-llama", pairs, Setting(micro_batch_size=1), capture=True)
    layout = "packed" if mode == "decode" else layout
    other = run("tiny-llama", pairs, Setting(micro_batch_size=size, layout=layout, mode=mode), capture=True)
    for a, b in zip(alone.logprobs, other.logprobs):
        assert torch.equal(a, b)
    for name in alone.states:
        for a, b in zip(alone.states[name], other.states[name]):
            assert a.shape == b.shape and torch.equal(a, b), name


def test_run_rejects_bad_sequences():
    with pytest.raises(InputError, match="non-empty list"):
        run("tiny-llama", [], Setting())
    with pytest.raises(InputError, match="prompt_ids is empty"):
        run("tiny-llama", [((), (5,))], Setting())
    with pytest.raises(InputError, match=r"sequences\[1\] must be"):
        run("tiny-llama", [((3,), (5,)), 7], Setting())
    with pytest.raises(InputError, match="outside the vocabulary"):
        run("tiny-llama", [((3,), (99999,))], Setting())


# -------------------------------------------------------------------------------------------
# Op ablation


def test_drift_between():
    a = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    assert Drift.between(a, a) == Drift(0.0, 0.0, 0.0)
    d = Drift.between(a, [torch.tensor([-1.0, -2.5]), torch.tensor([-0.5])])
    assert d.max_abs == 0.5 and d.mean_abs == pytest.approx(0.5 / 3) and d.k3_kl > 0


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("axis", ["batch", "layout", "mode"])
@pytest.mark.slow
def test_all_invariant_attribution_is_exactly_zero(model, axis):
    a, b = axis_settings(axis, dtype="float32")
    result = attribute_ops(model, _pairs(2), a, b, families=["rmsnorm", "moe"])
    assert result.baseline == Drift(0.0, 0.0, 0.0)
    # stock MoE experts are batch-variant where the host's GEMM rounds by row count (each expert's
    # GEMM sees however many tokens chose it), so only the all-invariant row is zero by
    # construction: on the MoE model the moe family carries all the drift there is; RMSNorm is
    # row-wise (the switch runs it on one thread) and the dense model has no experts, so there no
    # family adds any. How much stock drift there is depends on the host's BLAS: on the AVX2 host
    # every axis showed some; on an AMX host the tiny experts' GEMMs round alike on the layout axis.
    moe = next(r for r in result.families if r.family == "moe")
    assert model == "tiny-qwen3-moe" or moe.added == 0.0
    expected = 1.0 if moe.added > 0 else 0.0
    assert {r.family: r.share for r in result.families} == {"rmsnorm": 0.0, "moe": expected}


@pytest.mark.slow
def test_a_setting_against_itself_is_exactly_zero_with_any_kernels():
    a, _ = axis_settings("batch", dtype="float32")
    result = attribute_ops("tiny-llama", _pairs(3), a, a)
    zero = Drift(0.0, 0.0, 0.0)
    assert result.baseline == zero and result.all_native == zero
    assert all(r.native_only == zero and r.invariant_only == zero for r in result.families)
    assert "No family drifts on its own" not in ops_text(result.to_dict())


@pytest.mark.slow
def test_batch_variant_family_is_ranked_first(monkeypatch):
    _variant_native_rms_norm(monkeypatch)
    a, b = axis_settings("batch", dtype="float32")
    result = attribute_ops("tiny-llama", _pairs(4), a, b)
    assert result.ranking[0] == "rmsnorm"
    top = result.families[0]
    assert top.share > 0.5 and top.added > 0 and top.native_only.max_abs > 0 and top.native_only.k3_kl > 0
    assert result.baseline == Drift(0.0, 0.0, 0.0)  # invariant RMSNorm is untouched by the injection
    assert top.removed > 0  # making only RMSNorm invariant removes drift from stock kernels
    assert set(result.ranking) == set(kernels.FAMILIES)


@pytest.mark.slow
def test_negative_control_same_comparison_sees_the_injection(monkeypatch):
    """The zero of test_all_invariant_attribution_is_exactly_zero is not a blind spot: the same
    pipeline reports drift once one family is batch-variant (here rmsnorm switched native)."""
    _variant_native_rms_norm(monkeypatch)
    a, b = axis_settings("batch", dtype="float32")
    result = attribute_ops("tiny-llama", _pairs(2), a, b, families=["rmsnorm", "moe"])
    by_family = {r.family: r for r in result.families}
    assert by_family["rmsnorm"].native_only.max_abs > 0
    assert by_family["moe"].native_only.max_abs == 0.0


def test_attribute_ops_rejects_bad_arguments():
    a, b = axis_settings("batch")
    with pytest.raises(ConfigError, match="Setting instances"):
        attribute_ops("tiny-llama", _pairs(0), a, "batch")
    with pytest.raises(ConfigError, match="families is empty"):
        attribute_ops("tiny-llama", _pairs(0), a, b, families=[])
    with pytest.raises(ConfigError, match="unknown families"):
        attribute_ops("tiny-llama", _pairs(0), a, b, families=["gemm"])
    with pytest.raises(InputError, match="every response in sequences is empty"):
        attribute_ops("tiny-llama", [((3, 4), ())], a, b)


# -------------------------------------------------------------------------------------------
# Layer probe


def _scale_when_batched(module, args, output):
    return output * PERTURBATION if _batched(output) else output


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layer, op", [(0, "self_attn.o_proj"), (1, "post_attention_layernorm")])
@pytest.mark.slow
def test_layer_probe_finds_the_one_perturbed_layer(model, layer, op):
    lm = load_model(model)
    a, b = axis_settings("batch", dtype="float32")
    pairs = _pairs(5)
    with _hook(lm.model.model.layers[layer].get_submodule(op), _scale_when_batched):
        probe = layer_diff(lm, pairs, a, b)
    assert probe.first_differing == f"layer.{layer}"
    names = [s.stage for s in probe.stages]
    first = names.index(f"layer.{layer}")
    assert all(s.differing == 0 and s.max_abs == 0.0 and s.rel_error == 0.0 for s in probe.stages[:first])
    assert all(s.differing > 0 and s.rel_error > 0 for s in probe.stages[first:])


@pytest.mark.parametrize("axis", ["batch", "layout", "mode"])
@pytest.mark.slow
def test_layer_probe_negative_control_invariant_is_equal_everywhere(axis):
    a, b = axis_settings(axis, dtype="float32")
    probe = layer_diff("tiny-llama", _pairs(6), a, b)
    assert probe.first_differing is None
    assert all(s.differing == 0 and s.rel_error == 0.0 for s in probe.stages)
    assert all(s.elements > 0 for s in probe.stages)


def test_layer_probe_dtype_axis_differs_from_the_embeddings_on():
    a, b = axis_settings("dtype")
    probe = layer_diff("tiny-llama", _pairs(7), a, b)
    assert probe.first_differing == "embed"
    assert 0 < probe.stages[0].rel_error < 1e-2


# -------------------------------------------------------------------------------------------
# Rendering, report section, CLI


@pytest.mark.slow
def test_section_is_json_and_renders(monkeypatch):
    _variant_native_rms_norm(monkeypatch)
    section = attribution_section("tiny-llama", _pairs(8, count=2), axes=["batch"], dtype="float32",
                                  families=["matmul", "rmsnorm"])
    loaded = json.loads(json.dumps(section))
    entry = loaded["axes"][0]
    assert entry["axis"] == "batch" and entry["ops"]["ranking"][0] == "rmsnorm"
    assert entry["layers"]["first_differing"] == "layer.0"  # the first RMSNorm runs inside layer 0
    page = section_html(loaded)
    assert page.count("<img") == 2 and "rmsnorm" in page and "first differing stage" in page
    assert "rmsnorm" in ops_text(entry["ops"]) and "layer.0" in layers_text(entry["layers"])
    with pytest.raises(ConfigError, match="axes must name"):
        attribution_section("tiny-llama", _pairs(8), axes=["threads"])


def test_text_notes_drift_that_only_all_native_kernels_show():
    zero, some = Drift(0.0, 0.0, 0.0).to_dict(), Drift(1e-6, 1e-7, 1e-13).to_dict()
    row = {"family": "matmul", "share": 0.0, "added": 0.0, "removed": 1e-7, "native_only": zero,
           "invariant_only": zero}
    ops = {"setting_a": Setting().to_dict(), "setting_b": Setting().to_dict(), "baseline": zero,
           "all_native": some, "families": [row], "num_sequences": 1, "num_tokens": 2}
    assert "No family drifts on its own" in ops_text(ops)
    assert "No family drifts on its own" in section_html({"axes": [{"axis": "batch", "description": "",
                                                                    "ops": ops}]})


@pytest.mark.slow
def test_cli_writes_json_and_html(tmp_path, capsys):
    out_json, out_html = tmp_path / "a.json", tmp_path / "a.html"
    code = main(["--model", "tiny-llama", "--dtype", "float32", "--max-sequences", "2",
                 "--families", "matmul", "--axis", "layout", "--json", str(out_json),
                 "--html", str(out_html)])
    assert code == 0
    section = json.loads(out_json.read_text())
    assert section["model"] == "tiny-llama" and section["axes"][0]["ops"]["num_sequences"] == 2
    assert out_html.read_text().startswith("<!DOCTYPE html>")
    assert "axis layout" in capsys.readouterr().out


def test_cli_errors():
    from parity.cli import main as parity_main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert parity_main(["attribute", "--model", "tiny-llama", "--max-sequences", "0"]) == 2


@pytest.mark.slow
def test_compare_attaches_attribution_to_the_report_and_its_html(tmp_path):
    """`parity compare --attribute batch` puts the section into the JSON and the HTML page."""
    from parity.cli import main as cli_main
    from parity.report.document import ParityReport

    out, page = tmp_path / "r.json", tmp_path / "r.html"
    code = cli_main(["compare", "--model", "tiny-llama", "--backend", "reference", "--dtype", "float32",
                     "--attribute", "batch", "--json", str(out), "--html", str(page)])
    assert code == 0
    report = ParityReport.from_json(out.read_text())
    (axis,) = report.extras["attribution"]["axes"]
    assert axis["axis"] == "batch" and "ops" in axis and "layers" in axis
    assert "Drift attribution" in page.read_text()
