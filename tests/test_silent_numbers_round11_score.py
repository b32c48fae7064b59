"""Round 11, `parity score --case` and `parity.score`'s per-request sampling: a rollout takes the
sampling of the case request of its id only when it carries that request's prompt, and a dump's rows
without a logprobs mode are read in the mode the case (or the given sampling) names."""

from __future__ import annotations

import dataclasses
import json

import pytest

import parity
from parity.cli import main
from parity.core.errors import ConfigError, InputError
from parity.core.tables import read_rows, write_rows
from parity.core.types import Request, SamplingParams
from parity.rollouts.dumps import dump_rollouts
from parity.rollouts.record import read_record
from parity.workload.cases import Case

#: two requests whose processed logprobs differ a lot between their temperatures.
TWO = Case(name="two", model="tiny-llama", requests=(
    Request((1, 2), SamplingParams(temperature=0.5, max_tokens=4, seed=1), request_id="0"),
    Request((3, 4), SamplingParams(temperature=1.5, max_tokens=4, seed=2), request_id="1")))

RAW_CASE = """
model = "tiny-llama"
logprobs_mode = "raw"
[prompts]
text = ["hello there", "ab"]
[sampling]
temperature = 0.7
max_tokens = 5
seed = 3
"""


def _bare_rows(record, backend="reference", drop=("request_id", "sample_index")):
    """The record's rollouts as dump rows without sampling and without the columns `drop`."""
    rollouts = [dataclasses.replace(r, sampling=None) for r in read_record(record).rollouts[backend]]
    path = dump_rollouts(record.with_suffix(".all.jsonl"), rollouts)
    rows = [row for _, row in read_rows(path)]
    for row in rows:
        for name in drop:
            row.pop(name)
    return rows


@pytest.fixture(scope="module")
def two_rows(tmp_path_factory):
    """Rows (no ids, no sampling) of the reference backend's rollouts of `TWO`, in the case's order."""
    root = tmp_path_factory.mktemp("two")
    parity.compare(None, "reference", case=TWO, record=root / "run.jsonl", dtype="float32")
    return root, _bare_rows(root / "run.jsonl")


@pytest.fixture(scope="module")
def raw_run(tmp_path_factory):
    """A raw-mode text case, its compare record, and its rollouts as a dump with neither ids nor
    logprobs_mode nor sampling columns."""
    root = tmp_path_factory.mktemp("raw")
    (root / "raw.toml").write_text(RAW_CASE)
    assert main(["compare", "--case", str(root / "raw.toml"), "--backend", "reference", "--dtype",
                 "float32", "--record", str(root / "run.jsonl")]) == 0
    rows = _bare_rows(root / "run.jsonl", drop=("request_id", "sample_index", "logprobs_mode"))
    return root, rows


def test_a_reordered_dump_is_not_scored_under_another_requests_sampling(two_rows):
    """Rows of a dump without ids take their ids from row order; reversed, the row of prompt (3, 4)
    became request "0" and was scored at temperature 0.5 instead of 1.5: a drift of 5.04, silently."""
    root, rows = two_rows
    ordered = write_rows(root / "ordered.jsonl", rows)
    reordered = write_rows(root / "reordered.jsonl", rows[::-1])
    assert parity.score(ordered, "tiny-llama", case=TWO, dtype="float32").summary["max_abs_logprob_diff"] == 0
    with pytest.raises(InputError) as caught:
        parity.score(reordered, "tiny-llama", case=TWO, dtype="float32")
    message = str(caught.value)
    for part in ("row 1 (request_id '0'", "has the prompt (3, 4)", "request '0' has (1, 2)",
                 "request_id column", "order its rows one per case request"):
        assert part in message


def test_case_and_sampling_are_exclusive_and_apply_to_files(two_rows):
    root, rows = two_rows
    dump = write_rows(root / "exclusive.jsonl", rows)
    with pytest.raises(ConfigError, match="not both"):
        parity.score(dump, "tiny-llama", case=TWO, sampling=SamplingParams())
    rollouts = read_record(root / "run.jsonl").rollouts["reference"]
    with pytest.raises(ConfigError, match="apply to a file"):
        parity.score(rollouts, "tiny-llama", case=TWO)


def test_the_cli_refuses_a_reordered_dump_of_a_text_case(raw_run, tmp_path, capsys):
    """Text prompts are compared as the case encodes them (the tokenization compare uses)."""
    root, rows = raw_run
    dump = write_rows(tmp_path / "reordered.jsonl", rows[::-1])
    argv = ["score", str(dump), "--case", str(root / "raw.toml"), "--model", "tiny-llama", "--logprobs-mode",
            "raw"]
    assert main(argv) == 2  # old: 0, the reordered rows accepted
    err = capsys.readouterr().err
    assert "reordered.jsonl: row 1 (request_id '0', sample 0) has the prompt" in err
    assert "but the case's request '0' has" in err


def test_a_raw_case_reads_a_dump_without_a_mode_column_as_raw(raw_run, tmp_path):
    """`--case` of a raw-mode case: rows without logprobs_mode were read as processed at the case's
    temperature 0.7, a drift of 0.53 (FAIL) for rollouts identical to the trainer's."""
    root, rows = raw_run
    dump = write_rows(tmp_path / "raw.jsonl", rows)
    out = tmp_path / "score.json"
    assert main(["score", str(dump), "--case", str(root / "raw.toml"), "--model", "tiny-llama",
                 "--dtype", "float32", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["summary"]["max_abs_logprob_diff"] == 0


def test_given_sampling_names_the_mode_of_rows_without_one(raw_run, tmp_path):
    """`sampling=SamplingParams(..., logprobs_mode="raw")` was silently read as processed."""
    _, rows = raw_run
    dump = write_rows(tmp_path / "raw.jsonl", rows)
    raw = SamplingParams(temperature=0.7, logprobs_mode="raw")
    report = parity.score(dump, "tiny-llama", sampling=raw, dtype="float32")
    assert report.summary["max_abs_logprob_diff"] == 0
    mixed = {"0": raw, "1": SamplingParams(temperature=0.7)}
    with pytest.raises(ConfigError, match=r"names the logprobs modes \['processed', 'raw'\]"):
        parity.score(dump, "tiny-llama", sampling=mixed, dtype="float32")
    # an explicit logprobs_mode still decides
    processed = parity.score(dump, "tiny-llama", sampling=raw, logprobs_mode="processed", dtype="float32")
    assert processed.summary["max_abs_logprob_diff"] > 0.1


def test_trainer_logprobs_by_request_id_are_refused_naming_the_pairing(two_rows):
    """A dict by request id was zipped by its keys ("must be a list of numbers, got '0'"); a generator
    escaped as a TypeError. Both now say a list pairs with the rollouts by position."""
    root, _ = two_rows
    rollouts = read_record(root / "run.jsonl").rollouts["reference"]
    by_id = {r.request_id: list(r.logprobs) for r in rollouts}
    with pytest.raises(ConfigError, match="paired with the rollouts by position, got a dict"):
        parity.score(rollouts, "tiny-llama", trainer_logprobs=by_id)
    with pytest.raises(ConfigError, match="got a generator"):
        parity.score(rollouts, "tiny-llama", trainer_logprobs=(list(r.logprobs) for r in rollouts))
    listed = parity.score(rollouts, "tiny-llama", trainer_logprobs=list(by_id.values()))
    assert listed.summary["max_abs_logprob_diff"] == 0


def test_score_with_a_case_judges_by_its_limits_and_dtype(two_rows):
    """A case's [tolerance] and dtypes were ignored by `score --case`: the verdict used the default
    limits and bfloat16, where compare of the same case used the case's."""
    from parity.drift.tolerance import Tolerance

    root, rows = two_rows
    dump = write_rows(root / "limits.jsonl", rows)
    strict = dataclasses.replace(TWO, tolerance=Tolerance(max_abs_logprob_diff=1e-9), dtypes=("float32",))
    report = parity.score(dump, "tiny-llama", case=strict)
    assert report.tolerance.max_abs_logprob_diff == 1e-9 and report.provenance["dtype"] == "float32"
    plain = parity.score(dump, "tiny-llama", case=TWO, dtype="float32")  # the control: no table, defaults
    assert plain.tolerance.max_abs_logprob_diff != 1e-9
