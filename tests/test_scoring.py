"""`parity score` and `parity.score`: rollouts produced elsewhere get the report `compare` builds.

Acceptance: scoring the record `parity compare --record` writes, or a dump of the same rollouts,
reproduces the compare report's summary exactly; with a trainer-logprob column no forward runs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import parity
import parity.engine
from parity.cli import main
from parity.core.errors import ConfigError, InputError
from parity.core.types import SamplingParams
from parity.report.document import ParityReport
from parity.rollouts.dumps import dump_rollouts
from parity.rollouts.record import read_record

SMALL_CASE = """
model = "tiny-llama"
[prompts]
token_ids = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43]]
[sampling]
n = 2
temperature = 0.7
top_p = 0.9
top_k = 20
max_tokens = 8
seed = 3
"""


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """`parity compare --backend hf --record`: the report and the record of one drifting run."""
    root = tmp_path_factory.mktemp("run")
    (root / "case.toml").write_text(SMALL_CASE)
    argv = ["compare", "--case", str(root / "case.toml"), "--backend", "hf",
            "--record", str(root / "run.jsonl"), "--json", str(root / "compare.json")]
    assert main(argv) == 0
    return ParityReport.from_json((root / "compare.json").read_text()), root / "run.jsonl"


def scored(argv, tmp_path):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "score.json"
    code = main(["score", *argv, "--json", str(out)])
    return code, (ParityReport.from_json(out.read_text()) if out.exists() else None)


@pytest.mark.slow
def test_score_of_the_compare_record_reproduces_the_summary(hf_run, tmp_path, capsys):
    report, record = hf_run
    assert report.summary["max_abs_logprob_diff"] > 0  # drift, so equality means something
    code, again = scored([str(record)], tmp_path)
    assert code == 0 and again.summary == report.summary
    np.testing.assert_array_equal(again.train_logprobs, report.train_logprobs)
    assert again.provenance["model"] == "tiny-llama" and again.provenance["dtype"] == "bfloat16"
    assert again.provenance["backend"] == "hf" and again.tolerance == report.tolerance
    assert again.provenance["train_logprobs"] == report.provenance["train_logprobs"] == \
        "computed here by the training forward"
    assert again.provenance["rollout_logprobs"] == f"from record {record} (backend 'hf')"
    out = capsys.readouterr().out
    assert "parity PASS: backend=hf" in out and "train logprobs: computed here" in out


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_score_of_a_dump_reproduces_the_summary(hf_run, tmp_path, suffix):
    report, record = hf_run
    dump = dump_rollouts(tmp_path / f"hf{suffix}", read_record(record).rollouts["hf"])
    code, again = scored([str(dump), "--model", "tiny-llama", "--backend", "hf"], tmp_path)
    assert code == 0 and again.summary == report.summary


def test_trainer_logprob_column_runs_no_forward(hf_run, tmp_path, monkeypatch, capsys):
    report, record = hf_run
    rollouts = read_record(record).rollouts["hf"]
    train = [report.train_logprobs[i, :len(r.token_ids)].tolist() for i, r in enumerate(rollouts)]
    dump = dump_rollouts(tmp_path / "with_trainer.jsonl", rollouts, train)

    def no_forward(*args, **kwargs):
        raise AssertionError("the training forward ran")

    monkeypatch.setattr(parity.engine, "train_forward", no_forward)
    code, again = scored([str(dump), "--trainer-logprobs", "--backend", "hf"], tmp_path)
    # no model, no gold forward: the summary is the compare's without its gold keys
    drift = {k: v for k, v in report.summary.items() if not k.startswith("gold/")}
    assert code == 0 and again.summary == drift and again.provenance["model"] is None
    assert again.extras["gold"]["ran"] is False
    side = ("from the dump's 'trainer_logprobs' column (not computed here; no forward ran, so the rollouts' "
            "sampling columns were not checked)")
    assert again.provenance["train_logprobs"] == side
    assert f"train logprobs: {side}" in capsys.readouterr().out
    # the negative control: without the flag the forward runs (and here, raises: exit 2, one line)
    assert main(["score", str(dump), "--model", "tiny-llama"]) == 2
    assert "the training forward ran" in capsys.readouterr().err


def test_verl_old_log_probs_and_exit_code_1_when_the_tolerance_fails(tmp_path):
    rows = [{"prompts": [0, 5, 6], "responses": [7, 8, 0], "attention_mask": [0, 1, 1, 1, 1, 0],
             "rollout_log_probs": [-0.5, -1.0, 0.0], "old_log_probs": [-0.5, -2.5, 0.0], "uid": "g"}]
    path = tmp_path / "verl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, report = scored([str(path), "--trainer-logprobs", "--temperature", "1.0"], tmp_path)
    assert code == 1 and report.summary["max_abs_logprob_diff"] == 1.5 and not report.passed
    side = report.provenance["train_logprobs"]
    assert side.startswith("from the dump's 'old_log_probs' column (not computed here")
    assert report.provenance["sampling_checked"] is False
    code, _ = scored([str(path), "--trainer-logprobs"], tmp_path / "x")
    assert code == 2  # processed rows without sampling


@pytest.mark.slow
def test_router_summary_of_a_moe_record_is_reproduced(tmp_path):
    record = tmp_path / "moe.jsonl"
    argv = ["compare", "--model", "tiny-qwen3-moe", "--backend", "reference", "--router-replay", "R3",
            "--record", str(record), "--json", str(tmp_path / "c.json")]
    assert main(argv) == 0
    report = ParityReport.from_json((tmp_path / "c.json").read_text())
    code, again = scored([str(record), "--router-replay", "R3"], tmp_path)
    assert code == 0 and again.summary == report.summary and again.summary["router_agreement"] == 1.0
    assert again.extras["router"] == report.extras["router"]


@pytest.mark.slow
def test_a_replayed_record_names_its_backend(hf_run, tmp_path, capsys):
    """`parity replay` output holds two backends' rollouts: score takes one, by name."""
    _, record = hf_run
    both = tmp_path / "both.jsonl"
    assert main(["replay", str(record), "--backend", "reference", "--out", str(both)]) == 0
    assert main(["score", str(both)]) == 2
    err = capsys.readouterr().err
    assert "holds rollouts of ['hf', 'reference']; pick one with backend= (--backend)" in err
    code, ref = scored([str(both), "--backend", "reference", "--dtype", "bfloat16"], tmp_path)
    assert code == 0 and ref.summary["max_abs_logprob_diff"] == 0.0
    assert ref.tolerance.max_abs_logprob_diff == 0  # the reference backend's exact default


def test_sampling_from_the_command_line_or_a_case(hf_run, tmp_path, capsys):
    """A dump without sampling: refused, then scored under the sampling the flags or the case give."""
    report, record = hf_run
    rollouts = [dataclasses.replace(r, sampling=None) for r in read_record(record).rollouts["hf"]]
    dump = dump_rollouts(tmp_path / "bare.jsonl", rollouts)
    assert main(["score", str(dump), "--model", "tiny-llama"]) == 2
    assert "bare.jsonl:1: processed logprobs but no sampling parameters" in capsys.readouterr().err
    case = tmp_path / "case.toml"
    case.write_text(SMALL_CASE)
    base = [str(dump), "--model", "tiny-llama", "--backend", "hf"]
    code, cased = scored([*base, "--case", str(case)], tmp_path)
    assert code == 0 and cased.summary == report.summary
    flags = ["--temperature", "0.7", "--top-p", "0.9", "--top-k", "20"]
    code, flagged = scored([*base, *flags], tmp_path / "f")
    assert code == 0 and flagged.summary == report.summary
    assert main(["score", str(dump), "--case", str(case), "--temperature", "1"]) == 2
    assert "not both" in capsys.readouterr().err


def test_python_api_takes_rollouts_and_checks_its_arguments(hf_run):
    report, record = hf_run
    rollouts = read_record(record).rollouts["hf"]
    assert parity.score(rollouts, "tiny-llama").summary == report.summary
    with pytest.raises(ConfigError, match="name no model"):
        parity.score(rollouts)
    with pytest.raises(ConfigError, match="apply to a file"):
        parity.score(rollouts, "tiny-llama", sampling=SamplingParams())
    with pytest.raises(ConfigError, match="reads a dump's trainer-logprob column; these rollouts come from a "
                                          "record"):
        parity.score(record, trainer_logprobs="dump")
    dump = dump_rollouts(record.with_suffix(".dump.jsonl"), rollouts)
    with pytest.raises(InputError, match="no trainer-logprob column"):
        parity.score(dump, trainer_logprobs="dump")
    with pytest.raises(InputError, match="tokens but 1 trainer logprobs"):
        parity.score(rollouts, trainer_logprobs=[[-1.0]] * len(rollouts))
    with pytest.raises(ConfigError, match="reference must be one of"):
        parity.score(rollouts, "tiny-llama", reference="fast")
