"""Round 5, the command lines: an option a user gives takes effect or is refused, naming it and the
fix, before any engine starts. Each test is a case that the old code accepted and then ignored, or
used to overwrite a file it had read or written:

- an output path that is an input (`advise R --json R`, `score D --json D`, `compare --case C --json C`)
  or another output (`--json X --html X`, `--record X --json X`, `monitor --json OUT_DIR/index.html`);
- `--option KEY=...` given twice with different values (the last one won; every command reads them
  with `parity.backends.parse_options`), a compare `--option` that collides with one of its flags (a
  TypeError), `--tp` beside another `--option tensor_parallel_size`;
- `audit --option seed=N`, which set the audit's request seed instead of the engine's;
- `attribute --backend` with the op-ablation options (--axis, --families, ...), which it ignored, and
  `--versus K=V` with `--option K=V` (both sides one setting);
- `score --logprobs-mode` on a record whose rollouts carry another mode (ignored);
- `advise --bootstrap -5` (accepted and printed as -5 resamples);
- `replay` sampling in bfloat16 a record whose rollouts were sampled in float32.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from test_report import make_report

from parity.cli import main
from parity.core.types import Request, Rollout, SamplingParams
from parity.rollouts.record import write_record

MODEL = "tiny-llama"


class Started(BaseException):
    """Raised where an engine (or the work) would start; a BaseException, so no frame turns it into exit 2."""


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Every engine start raises `Started`; the keyword arguments it got are kept in the dict."""
    seen: dict[str, Any] = {}

    def started(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs, args=args)
        raise Started("an engine would start here")

    import parity.attribute.probe
    import parity.audit.command
    import parity.rollouts.command  # noqa: F401  (the modules whose names are patched below)

    monkeypatch.setattr(sys.modules["parity.compare"], "shared_backend", started)
    monkeypatch.setattr(sys.modules["parity.rollouts.command"], "get_backend", started)
    monkeypatch.setattr(sys.modules["parity.audit.command"], "audit", started)
    monkeypatch.setattr(sys.modules["parity.attribute.probe"], "engine_diff", started)
    return seen


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> str:
    """Run `parity ARGV`: exit 2, one error line holding every word; returns the line."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--verbose for the traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    return err


def record_file(path: Path, *, dtype: str = "float32", mode: str = "processed") -> Path:
    sampling = SamplingParams(temperature=1.0, max_tokens=4, seed=3, logprobs_mode=mode)
    request = Request((5, 6, 7), sampling, request_id="r0")
    rollout = Rollout("r0", 0, (5, 6, 7), (8, 9), (-0.5, -1.0), "length", "reference", logprobs_mode=mode,
                      meta={"dtype": dtype}, sampling=sampling)
    return write_record(path, [request], [rollout], model=MODEL)


# -- outputs over inputs and over each other ------------------------------------------------------


def test_advise_refuses_to_write_over_its_report_or_one_output_over_the_other(tmp_path, capsys):
    report = tmp_path / "r.json"
    text = make_report(scale=0.3).to_json()
    report.write_text(text)
    # old: the advice JSON replaced the report, and the next `parity advise r.json` had nothing to read
    refused(["advise", str(report), "--json", str(report)], capsys, "--json", "REPORT")
    refused(["advise", str(report), "--html", str(tmp_path / "." / "r.json")], capsys, "--html", "REPORT")
    refused(["advise", str(report), "--json", str(tmp_path / "a"), "--html", str(tmp_path / "a")], capsys,
            "--html", "--json")
    assert report.read_text() == text


def test_advise_refuses_a_negative_bootstrap(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:  # old: accepted, "-5 bootstrap resamples of sequences"
        main(["advise", str(tmp_path / "r.json"), "--bootstrap", "-5"])
    assert info.value.code == 2 and "--bootstrap" in capsys.readouterr().err


def test_score_refuses_to_write_over_its_source(tmp_path, capsys, no_engine):
    source = record_file(tmp_path / "run.jsonl")
    before = source.read_text()
    refused(["score", str(source), "--json", str(source)], capsys, "--json", "SOURCE")
    refused(["score", str(source), "--html", str(source)], capsys, "--html", "SOURCE")
    refused(["score", str(source), "--json", str(tmp_path / "x"), "--html", str(tmp_path / "x")], capsys,
            "--html", "--json")
    assert source.read_text() == before


def test_compare_refuses_outputs_on_one_file_or_on_its_case(tmp_path, capsys, no_engine):
    case = tmp_path / "c.toml"
    case.write_text(f'model = "{MODEL}"\n[prompts]\ntoken_ids = [[3, 4, 5]]\n')
    out = str(tmp_path / "out.json")
    base = ["compare", "--model", MODEL, "--backend", "reference"]
    # old: the HTML replaced the JSON (and the report the record), each "wrote" printed
    refused([*base, "--json", out, "--html", out], capsys, "--html", "--json")
    refused([*base, "--record", out, "--json", out], capsys, "--json", "--record")
    refused([*base, "--record", out, "--html", out], capsys, "--html", "--record")
    refused(["compare", "--backend", "reference", "--case", str(case), "--json", str(case)], capsys,
            "--json", "--case")
    assert no_engine == {}


def test_monitor_refuses_a_json_over_its_store_or_its_page(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    refused(["monitor", str(out), "--json", str(out / "monitor.sqlite")], capsys, "--json", "store")
    refused(["monitor", str(out), "--html", str(out / "monitor.sqlite")], capsys, "--html", "store")
    refused(["monitor", str(out), "--json", str(out / "index.html")], capsys, "--json", "page")
    page = str(tmp_path / "p.html")
    refused(["monitor", str(out), "--json", page, "--html", page], capsys, "--json", "page")


def test_audit_and_attribute_refuse_one_file_for_json_and_html(tmp_path, capsys, no_engine):
    out = str(tmp_path / "o")
    refused(["audit", "--model", MODEL, "--backend", "reference", "--json", out, "--html", out], capsys,
            "--json and --html")
    refused(["attribute", "--model", MODEL, "--json", out, "--html", out], capsys, "--json and --html")
    assert no_engine == {}


# -- backend options ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", [
    ["compare", "--model", MODEL, "--backend", "reference"],
    ["audit", "--model", MODEL, "--backend", "reference"],
    ["attribute", "--model", MODEL, "--backend", "vllm"],
    ["lifecycle", "--model", MODEL, "--backend", "reference"],
])
def test_an_option_given_twice_with_two_values_is_refused(command, capsys, no_engine):
    # old: the last value won, the first was dropped without a word
    refused([*command, "--option", "max_num_seqs=2", "--option", "max_num_seqs=8"], capsys,
            "--option max_num_seqs is given twice")
    assert no_engine == {}


def test_loop_refuses_a_backend_option_given_twice(capsys, no_engine):
    refused(["loop", "--model", MODEL, "--option", "reference.chunk_size=2", "--option",
             "reference.chunk_size=4"], capsys, "--option chunk_size is given twice")
    assert no_engine == {}


def test_replay_refuses_an_option_given_twice(tmp_path, capsys, no_engine):
    record = record_file(tmp_path / "run.jsonl")
    refused(["replay", str(record), "--backend", "reference", "--option", "chunk_size=2", "--option",
             "chunk_size=4"], capsys, "--option chunk_size is given twice")
    assert no_engine == {}


def test_the_same_option_twice_with_one_value_still_runs(capsys, no_engine):
    with pytest.raises(Started):
        main(["compare", "--model", MODEL, "--backend", "reference", "--option", "chunk_size=4", "--option",
              "chunk_size=4"])
    assert no_engine["chunk_size"] == 4


def test_a_compare_option_that_is_a_flag_names_the_flag(capsys, no_engine):
    # old: "TypeError: compare() got multiple values for keyword argument 'device'"
    refused(["compare", "--model", MODEL, "--backend", "reference", "--option", "device=cpu"], capsys,
            "--option device", "--device")
    refused(["compare", "--model", MODEL, "--backend", "reference", "--tp", "2", "--option",
             "tensor_parallel_size=4"], capsys, "--tp 2", "tensor_parallel_size=4")
    assert no_engine == {}


def test_a_compare_argument_of_case_files_is_no_option(capsys, no_engine):
    # old: `--option tolerance={...}` reached compare(tolerance=...): the limits moved without a word
    base = ["compare", "--model", MODEL, "--backend", "reference", "--option"]
    refused([*base, 'tolerance={"max_abs_logprob_diff": 100}'], capsys, "--option tolerance", "[tolerance]")
    refused([*base, "correction={}"], capsys, "--option correction", "parity advise")
    for key in ("sampling", "prompts", "turns"):
        refused([*base, f"{key}=1"], capsys, f"--option {key}", "--case")
    assert no_engine == {}


def test_audit_refuses_option_seed_that_would_set_its_request_seed(capsys, no_engine):
    # old: `--option seed=7` reached audit(seed=7), the derived requests' seed, not the engine's
    refused(["audit", "--model", MODEL, "--backend", "vllm", "--option", "seed=7"], capsys, "--option seed")
    refused(["audit", "--model", MODEL, "--backend", "reference", "--option", "checks=repeat"], capsys,
            "--option checks", "--checks")
    assert no_engine == {}


# -- attribute: the engine probe and the ablation options -----------------------------------------


@pytest.mark.parametrize("extra, flag", [
    (["--axis", "mode"], "--axis"), (["--families", "attention"], "--families"),
    (["--probe-kernels", "invariant"], "--probe-kernels"), (["--no-ops"], "--no-ops"),
    (["--no-layers"], "--no-layers"),
])
def test_attribute_backend_refuses_the_ablation_options_it_ignored(extra, flag, capsys, no_engine):
    refused(["attribute", "--model", MODEL, "--backend", "vllm", *extra], capsys, flag, "--backend")
    assert no_engine == {}


def test_attribute_versus_an_option_both_sides_have_is_refused(capsys, no_engine):
    refused(["attribute", "--model", MODEL, "--backend", "vllm", "--option", "batch_invariant=true",
             "--versus", "batch_invariant=true"], capsys, "--versus batch_invariant=true", "one setting")
    with pytest.raises(Started):  # another value than --option's: two settings, as asked
        main(["attribute", "--model", MODEL, "--backend", "vllm", "--option", "batch_invariant=false",
              "--versus", "batch_invariant=true"])
    assert no_engine["side"].options != no_engine["against"].options


# -- score and replay: what the record carries ----------------------------------------------------


def test_score_refuses_a_logprobs_mode_a_record_does_not_carry(tmp_path, capsys, no_engine):
    record = record_file(tmp_path / "run.jsonl", mode="processed")
    # old: --logprobs-mode applied to dumps only; on a record it was dropped without a word
    refused(["score", str(record), "--logprobs-mode", "raw"], capsys, "--logprobs-mode raw", "record")


def test_replay_samples_in_the_records_dtype_unless_told(tmp_path, capsys, no_engine):
    record = record_file(tmp_path / "run.jsonl", dtype="float32")
    with pytest.raises(Started):  # old: bfloat16, whatever the run was sampled in
        main(["replay", str(record), "--backend", "reference"])
    assert no_engine["dtype"] == "float32"
    with pytest.raises(Started):
        main(["replay", str(record), "--backend", "reference", "--dtype", "bfloat16"])
    assert no_engine["dtype"] == "bfloat16"
    with pytest.raises(SystemExit) as info:  # old: any string reached the backend
        main(["replay", str(record), "--backend", "reference", "--dtype", "fp8"])
    assert info.value.code == 2
