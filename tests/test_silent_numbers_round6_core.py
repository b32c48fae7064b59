"""Vocabulary and workload definitions (parity/core, parity/workload) that accepted input meaning
something other than what was written, or wrote files that lost data; no engine starts here.

- a Parquet table kept only the first row's columns: a later rollout's response_mask (and any
  optional column the first row lacks) was dropped, so injected tokens were counted as generated;
- a Parquet table was written in place: a run killed mid-write left half a file over the old one;
- an injection function's return was passed through int(): 3.9 became 3, "7" became 7, True 1;
- top-k logprobs given as strings or bools were parsed into numbers;
- a top-k logprob a hair above 0 (an engine's rounded log 1) was refused while the same sampled
  logprob was accepted (`MAX_LOGPROB` is the one bound);
- `temperature = 1` and `temperature = 1.0` gave two case hashes, so nightly saw a changed workload;
- `Case(prefix_caching=("false",))` ran the prefix cache on; duplicate per-backend tolerances in a
  `Case` let the last silently win, duplicate dtypes ran a row twice;
- an empty sweep label gave its block plain request ids, outside the sweep;
- a case file that is not UTF-8 crashed with a UnicodeDecodeError instead of a ConfigError.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parity.core.errors import ConfigError
from parity.core.tables import read_rows, write_rows
from parity.core.top_k import TopKError
from parity.core.turns import Generate, Inject
from parity.core.types import Request, Rollout, SamplingParams
from parity.drift.tolerance import Tolerance
from parity.rollouts.dumps import dump_rollouts, read_dump
from parity.workload.cases import Case, load_case

MODEL = "tiny-llama"
TOKENS = f'model = "{MODEL}"\n[prompts]\ntoken_ids = [[3, 4, 5]]\n'


def write(tmp_path: Path, text: str, name: str = "case.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def rollout(request_id: str, tokens: tuple[int, ...], logprobs: tuple[float, ...], **kw) -> Rollout:
    return Rollout(request_id, 0, (3, 4), tokens, logprobs, "stop", "x", logprobs_mode="raw", **kw)


def test_a_parquet_dump_keeps_a_column_only_a_later_row_has(tmp_path):
    single = rollout("a", (5, 6), (-0.5, -1.0))
    multi = rollout("b", (5, 6, 7), (-0.5, 0.0, -2.0), response_mask=(1, 0, 1))
    trainer = [[-0.4, -1.1], [-0.6, 0.0, -2.5]]
    masks = {}
    for name in ("d.jsonl", "d.parquet"):
        dump = read_dump(dump_rollouts(tmp_path / name, [single, multi], trainer), logprobs_mode="raw")
        masks[name] = [r.response_mask for r in dump.rollouts]
    assert masks["d.parquet"] == masks["d.jsonl"] == [None, (1, 0, 1)]
    rows = [row for _, row in read_rows(write_rows(tmp_path / "t.parquet", [{"a": 1}, {"a": 2, "b": [3]}]))]
    assert rows == [{"a": 1, "b": None}, {"a": 2, "b": [3]}]


def test_a_parquet_write_that_dies_leaves_the_finished_file(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    path = write_rows(tmp_path / "done.parquet", [{"a": 1}])

    def dies(table, where, *args, **kwargs):
        Path(where).write_bytes(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", dies)
    with pytest.raises(OSError, match="disk full"):
        write_rows(path, [{"a": 2}])
    monkeypatch.undo()
    assert [row for _, row in read_rows(path)] == [{"a": 1}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done.parquet"]


@pytest.mark.parametrize("returned", [[3.9], [True], ["7"], [-1], "7"])
def test_an_injection_function_returning_other_than_token_ids_is_refused(returned):
    turn = Inject(fn=lambda history: returned, name="tool")
    with pytest.raises(ConfigError, match=r"injection 'tool': the ids it returned"):
        turn.tokens((1, 2))


def test_an_injection_function_may_return_a_list_an_array_or_a_generator():
    for returned in ([5, 6], np.array([5, 6]), (t for t in (5, 6))):
        assert Inject(fn=lambda history, r=returned: r, name="tool").tokens((1,)) == (5, 6)


@pytest.mark.parametrize("values", [[["-0.5", "-0.9"]], [[False, False]]])
def test_top_k_logprobs_given_as_strings_or_bools_are_refused(values):
    with pytest.raises(TopKError, match="top_k_logprobs must hold numbers"):
        rollout("a", (5,), (-0.5,), top_k_ids=[[5, 7]], top_k_logprobs=values)


def test_a_top_k_logprob_a_hair_above_zero_is_held_to_the_one_logprob_bound():
    r = rollout("a", (5,), (3e-5,), top_k_ids=[[5, 7]], top_k_logprobs=[[3e-5, -12.0]])
    assert r.top_k_logprobs[0, 0] == 3e-5
    r = rollout("a", (5,), (0.0,), top_k_ids=[[5, 7]], top_k_logprobs=[[0, -20]])  # integers are numbers
    assert r.top_k_logprobs.dtype == np.float64
    with pytest.raises(TopKError, match="holds NaN or a value >"):
        rollout("a", (5,), (0.5,), top_k_ids=[[5, 7]], top_k_logprobs=[[0.5, -1.0]])


def test_one_workload_has_one_hash_whether_its_numbers_are_written_1_or_1_0(tmp_path):
    ints = load_case(write(tmp_path, TOKENS + "[sampling]\ntemperature = 1\ntop_p = 1\n", "a.toml"))
    floats = load_case(write(tmp_path, TOKENS + "[sampling]\ntemperature = 1.0\ntop_p = 1.0\n", "b.toml"))
    assert ints.hash == floats.hash
    assert SamplingParams(temperature=1, top_p=1).to_dict() == SamplingParams().to_dict()
    assert type(SamplingParams(temperature=0).temperature) is float
    loop = [Case("l", MODEL, (Request((3, 4)),), kind="loop", loop_lr=lr) for lr in (1, 1.0)]
    assert loop[0].hash == loop[1].hash


def trajectory(**kw) -> Case:
    return Case("t", MODEL, (Request((3, 4), turns=(Generate(2),)),), kind="trajectory", **kw)


@pytest.mark.parametrize("caching", [("false",), (True, True), (1,), [True]])
def test_prefix_caching_of_a_case_must_be_distinct_true_false_values(caching):
    with pytest.raises(ConfigError, match="prefix_caching must hold distinct True/False values"):
        trajectory(prefix_caching=caching)
    assert trajectory(prefix_caching=(True, False)).prefix_caching == (True, False)


def test_a_value_given_twice_in_a_case_is_refused():
    request = (Request((3, 4)),)
    strict, loose = Tolerance.exact(), Tolerance()
    with pytest.raises(ConfigError, match=r"tolerance.<backend> has 'hf' twice"):
        Case("c", MODEL, request, backend_tolerances=(("hf", strict), ("hf", loose)))
    with pytest.raises(ConfigError, match=r"dtypes has 'bfloat16' twice"):
        Case("c", MODEL, request, dtypes=("bfloat16", "bfloat16"))
    case = Case("c", MODEL, request, backend_tolerances=(("hf", strict), ("vllm", loose)))
    assert case.tolerance_for("hf") == strict


@pytest.mark.parametrize("label", ['""', '"t\\u001b[31m"'])
def test_an_empty_or_unprintable_sweep_label_is_refused(tmp_path, label):
    sweep = f"[[sampling]]\nlabel = {label}\ntemperature = 0.5\n[[sampling]]\ntemperature = 1.0\n"
    with pytest.raises(ConfigError, match=r"sampling\[0\]\.label: must be non-empty printable text"):
        load_case(write(tmp_path, TOKENS + sweep))
    ok = load_case(write(tmp_path, TOKENS + sweep.replace(f"label = {label}", 'label = "cold"')))
    assert [r.request_id for r in ok.requests] == ["cold/0", "t1/0"]


def test_a_case_file_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin.toml"
    path.write_bytes('description = "caf\u00e9"\n'.encode("latin-1") + TOKENS.encode())
    with pytest.raises(ConfigError, match=r"latin\.toml: not UTF-8 text"):
        load_case(path)
    path.write_bytes('description = "caf\u00e9"\n'.encode() + TOKENS.encode())
    assert load_case(path).description == "caf\u00e9"
