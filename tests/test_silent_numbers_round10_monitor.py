"""Round 10, the training-time monitor and rollouts on disk: numbers that were silently wrong.

- `score(record, logprobs_mode=...)` (Python) dropped a mode the record's rollouts contradict, and
  `parity score --logprobs-mode` read the record twice (once to check, once to score);
- the monitor's jump alerts judged a step against the trailing median of steps of another sampling
  (processed drift scales with 1/temperature: a "missed weight sync" on a temperature change);
- thresholds on a fraction or probability beyond [0, 1] (a percentage, nats): alerts that never fire;
- `parity monitor` printed and wrote --json from one read of a live store and drew the page from another;
- a record of two files concatenated (two headers) took the second header's model for every rollout.
No engine starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from parity.core.errors import ConfigError, InputError
from parity.core.types import Request, Rollout, SamplingParams
from parity.monitor.core import Monitor
from parity.monitor.thresholds import Thresholds
from parity.rollouts.record import read_record, write_record
from parity.scoring import read_source


class Started(BaseException):
    """Raised where the scoring work would start (a BaseException: no frame turns it into exit 2)."""


def _record(path: Path, *, mode: str = "processed", model: str = "tiny-llama", rid: str = "r0",
            temperature: float = 1.0) -> Path:
    sampling = SamplingParams(temperature=temperature, max_tokens=4, seed=3, logprobs_mode=mode)
    request = Request((5, 6, 7), sampling, request_id=rid)
    rollout = Rollout(rid, 0, (5, 6, 7), (8, 9), (-0.5, -1.0), "length", "reference", logprobs_mode=mode,
                      meta={"dtype": "float32"}, sampling=sampling)
    return write_record(path, [request], [rollout], model=model)


# -- score: the logprobs mode of a record, read once ------------------------------------------------


def test_read_source_refuses_a_given_mode_a_record_contradicts(tmp_path):
    record = _record(tmp_path / "run.jsonl", mode="raw")
    # old: the raw rollouts came back and were scored as raw, the caller's "processed" dropped silently
    with pytest.raises(ConfigError, match="logprobs-mode processed"):
        read_source(record, logprobs_mode="processed")
    assert {r.logprobs_mode for r in read_source(record).rollouts} == {"raw"}
    assert {r.logprobs_mode for r in read_source(record, logprobs_mode="raw").rollouts} == {"raw"}


def test_score_cli_reads_the_record_once(tmp_path, monkeypatch):
    import parity.rollouts.record as record_module
    import parity.scoring
    from parity.cli import main

    record = _record(tmp_path / "run.jsonl", mode="raw")
    reads: list[str] = []
    real = record_module.read_jsonl

    def counted(path: Any) -> Any:
        reads.append(str(path))
        return real(path)

    def started(*args: Any, **kwargs: Any) -> None:
        raise Started

    monkeypatch.setattr(record_module, "read_jsonl", counted)
    monkeypatch.setattr(parity.scoring, "report_for", started)
    with pytest.raises(Started):
        main(["score", str(record), "--logprobs-mode", "raw"])
    assert len(reads) == 1, reads  # old: 2, a file changed in between checked one run and scored another


# -- the monitor's jump baseline is the steps sampled alike ---------------------------------------


def _arrays(drift: float) -> dict[str, np.ndarray]:
    old = np.full((4, 8), -0.7)
    rollout = old.copy()
    rollout[:, ::2] -= drift  # mean |Δ| = drift / 2, whatever the step
    return {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": np.ones((4, 8))}


def test_monitor_jumps_are_judged_against_steps_of_the_same_sampling(tmp_path):
    warm, cold = {"temperature": 1.0}, {"temperature": 0.1}
    with Monitor(tmp_path / "m", render_every=0, advice_every=0) as m:
        for step in range(6):
            m.log(step, **_arrays(0.01), sampling=warm)
        # the run turns the temperature down: processed drift scales with 1/T, the weights are in sync
        first_cold = m.log(6, **_arrays(0.1), sampling=cold)
        assert first_cold["alerts"] == []  # old: "mean_abs_logprob_diff ... 10x the trailing median"
        for step in range(7, 12):
            m.log(step, **_arrays(0.1), sampling=cold)
        jumped = m.log(12, **_arrays(1.0), sampling=cold)  # a real jump within one sampling is still one
        assert {a["key"] for a in jumped["alerts"]} >= {"mean_abs_logprob_diff"}
    # a monitor reopened on the run reads each sampling's baseline from the store: back at T=1, a
    # drift 10x the T=1 steps' is a jump (old: the median of both samplings' steps hid it)
    with Monitor(tmp_path / "m", render_every=0, advice_every=0) as m:
        assert {a["key"] for a in m.log(13, **_arrays(0.1), sampling=warm)["alerts"]} >= \
            {"mean_abs_logprob_diff"}


def test_monitor_without_sampling_keeps_one_baseline(tmp_path):
    with Monitor(tmp_path / "m", render_every=0, advice_every=0) as m:
        for step in range(6):
            m.log(step, **_arrays(0.01))
        assert m.log(6, **_arrays(0.1), sampling={"temperature": 1.0})["alerts"]  # unknown matches any


# -- thresholds in the metric's unit ------------------------------------------------------------


@pytest.mark.parametrize("spec", [
    {"frac_tokens_outside_support": 5},            # 5 percent, in a fraction: never crossed
    {"rollout_probs_diff_max": 2.0},               # nats, in a probability difference
    {"rollout_probs_pearson": (-2.0, None)},       # below any correlation
    {"rollout_corr/rollout_is_eff_sample_size": (None, 50)},
])
def test_thresholds_refuse_a_bound_a_bounded_metric_can_never_cross(spec):
    with pytest.raises(ConfigError, match="could never alert"):  # old: accepted, and it never fired
        Thresholds.of(spec)


def test_thresholds_keep_bounds_inside_the_range():
    bounds = Thresholds.of({"frac_tokens_outside_support": 0.05, "rollout_probs_pearson": (0.9, 1.0),
                            "rollout_probs_diff_max": (0.0, 1.0), "k3_kl": 50.0}).to_dict()
    assert bounds["frac_tokens_outside_support"] == [None, 0.05] and bounds["k3_kl"] == [None, 50.0]


# -- parity monitor: one read of a live store ------------------------------------------------------


def test_monitor_command_prints_and_draws_one_snapshot(tmp_path, monkeypatch, capsys):
    import parity.monitor.command
    import parity.monitor.page
    from parity.monitor.store import MonitorStore

    with Monitor(tmp_path / "m", render_every=0, advice_every=0) as m:
        m.log(0, **_arrays(0.01))
    opened: list[str] = []
    real = MonitorStore.open

    def counted(out_dir: Any) -> MonitorStore:
        opened.append(str(out_dir))
        return real(out_dir)

    monkeypatch.setattr(MonitorStore, "open", staticmethod(counted))
    assert parity.monitor.command.main([str(tmp_path / "m"), "--json", str(tmp_path / "s.json"),
                                        "--html", str(tmp_path / "p.html")]) == 0
    assert len(opened) == 1, opened  # old: 2, the page could show other steps than printed
    assert json.loads((tmp_path / "s.json").read_text())["steps"][0]["step"] == 0
    assert "parity monitor" in (tmp_path / "p.html").read_text()


# -- records: one header ----------------------------------------------------------------------------


def test_read_record_refuses_two_concatenated_records(tmp_path):
    a = _record(tmp_path / "a.jsonl", model="model-a", rid="a", temperature=0.7)
    b = _record(tmp_path / "b.jsonl", model="model-b", rid="b")
    both = tmp_path / "both.jsonl"
    both.write_text(a.read_text() + b.read_text())
    # old: read as one record of model-b, so a's rollouts were scored with b's model
    with pytest.raises(InputError, match="second header"):
        read_record(both)


@pytest.mark.parametrize("header, word", [({"model": 5}, "model"), ({"meta": [1]}, "meta")])
def test_read_record_refuses_a_header_of_the_wrong_types(tmp_path, header, word):
    line = {"kind": "header", "format": "parity-record", "version": 1, "model": None, "meta": {}, **header}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(InputError, match=word):  # old: meta [1] read, replay crashed on meta.get
        read_record(path)
