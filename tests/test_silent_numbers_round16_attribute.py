"""Round 16, attribution: drift and stage numbers that must not be silently wrong or misattributed."""

from types import SimpleNamespace

import pytest
import torch

from parity.attribute import attribute_ops, axis_settings, main
from parity.attribute.ablation import Drift
from parity.attribute.layers import StageDiff
from parity.attribute.probe import EngineProbe, compare_probes
from parity.attribute.section import attribution_section
from parity.attribute.stages import stage_order, stage_rank
from parity.core.errors import ConfigError, InputError

# --- an axis that was never applied ------------------------------------------------------------------

@pytest.mark.parametrize("axis", ["batch", "layout"])
def test_an_axis_whose_two_sides_are_one_forward_is_refused(axis):
    """Old: with 1 sequence, "batch 1" and "batch all" (or right-padded and packed) ran the very same
    [1, len] forward: all native 0.0 and "first differing stage: none (bitwise equal everywhere)",
    though the axis never changed anything."""
    with pytest.raises(ConfigError, match=rf"axes \['{axis}'\].*at least 2 sequences"):
        attribution_section("tiny-llama", [([1, 2, 3, 4, 5], [6, 7, 8, 9])], axes=[axis])


def test_the_mode_axis_still_runs_on_one_sequence():
    """Prefill against decode differs with one sequence too: not refused."""
    section = attribution_section("tiny-llama", [([1, 2, 3, 4, 5], [6, 7, 8])], axes=["mode"], ops=False)
    assert section["axes"][0]["layers"]["first_differing"] is not None


def test_settings_that_differ_only_in_the_ignored_kernels_are_refused():
    """Old: attribute_ops(invariant, native) replaced both sides' kernels with its own, ran one forward
    against itself and reported 0.0 drift for every family: kernels 'without effect'."""
    a, _ = axis_settings("batch")
    with pytest.raises(ConfigError, match="differ only in kernels"):
        attribute_ops("tiny-llama", [([1, 2], [3])], a, a.with_kernels("native"))


# --- Drift.between ---------------------------------------------------------------------------------

def test_drift_refuses_logprobs_of_different_lengths():
    """Old: side B's missing third logprob was read as 0.0: max_abs 3.0 of drift that is not there."""
    with pytest.raises(InputError, match=r"lengths \[3\] and side B of \[2\]"):
        Drift.between([torch.tensor([-1.0, -2.0, -3.0])], [torch.tensor([-1.0, -2.0])])


def test_drift_refuses_a_missing_sequence():
    """Old: zip dropped side A's second sequence and answered exactly 0 drift."""
    with pytest.raises(InputError, match="lengths"):
        Drift.between([torch.tensor([-1.0]), torch.tensor([-2.0])], [torch.tensor([-1.0])])


def test_drift_names_the_side_that_overflowed():
    """Old: a non-finite logprob of side B was refused as "train_logprobs ... allowed only in masked-out
    padding", naming neither the side nor the fix."""
    with pytest.raises(InputError, match=r"side B's logprobs of sequences \[1\] are NaN or infinite"):
        Drift.between([torch.tensor([-1.0]), torch.tensor([-1.0, -2.0])],
                      [torch.tensor([-1.0]), torch.tensor([-1.0, float("-inf")])])
    assert Drift.between([torch.tensor([-1.0])], [torch.tensor([-1.5])]).max_abs == 0.5


# --- StageDiff.between -------------------------------------------------------------------------------

def test_stage_diff_refuses_outputs_of_different_shapes():
    """Old: a [2, 3] output against a [3, 2] one was flattened and compared element by element."""
    a = torch.arange(6.0).reshape(2, 3)
    with pytest.raises(InputError, match=r"shapes \[\(2, 3\)\] differ from side B's \[\(3, 2\)\]"):
        StageDiff.between("layer.0", [a], [a.T.contiguous()])
    assert StageDiff.between("layer.0", [a], [a.clone()]).differing == 0


# --- the engine probe's forward order ------------------------------------------------------------------

def _probe(label, states):
    return EngineProbe(label=label, states={0: states},
                       rollouts=(SimpleNamespace(prompt_ids=[1, 2, 3], token_ids=[7, 8, 9, 10]),))


def test_first_differing_is_by_forward_order_not_by_the_order_stored():
    """Side B's stages stored in another order (here alphabetical: "layer.10" before "layer.2"). Old:
    first differing "layer.10" though layer.2 parts first, and depth/growth read layer.2 as the last."""
    gen = torch.Generator().manual_seed(0)
    names = stage_order(["embed", "layer", "norm"], 11)
    a = {name: torch.randn(6, 4, generator=gen) for name in names}
    b = {name: x.clone() for name, x in a.items()}
    b["layer.2"] = b["layer.2"] + 1e-3
    for name in names[names.index("layer.3"):]:
        b[name] = b[name] + 1.0
    diff = compare_probes("m", "vllm", _probe("A", a), _probe("B", dict(sorted(b.items()))))
    prefill = diff.phase("prefill")
    assert prefill.first_differing == "layer.2"
    assert [s.stage for s in prefill.stages] == names
    assert prefill.growth == pytest.approx(prefill.stages[-2].rel_error / prefill.stages[3].rel_error)


def test_stage_rank_is_stage_order():
    names = stage_order(["embed", "attn", "router", "mlp", "layer", "norm", "logits"], 12, [1, 11])
    assert sorted(reversed(names), key=stage_rank) == names


# --- the command line --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--families", "matmul", "--no-ops"],
                                  ["--probe-kernels", "invariant", "--no-layers"]])
def test_an_option_of_a_skipped_part_is_refused(argv, capsys):
    """Old: the option was silently dropped, and the report ran as if it had been applied."""
    assert main(["--model", "tiny-llama", *argv]) == 2
    assert "would have no effect" in capsys.readouterr().err
