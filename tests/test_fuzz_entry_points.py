"""A standing guard: every public entry point, driven with generated malformed input, either does
its job or raises a `ParityError` naming the field and the fix, never another exception (a
TypeError or an IndexError from deep inside NumPy or torch is a traceback the user cannot act on).

Entry points: `parity.compare` (reference backend, tiny model), `parity.loop`, `Monitor.log`,
`train_forward`, `load_case` on generated TOML, `load_rollouts` and `read_record` on generated
files, and the command line (`parity compare`, `parity nightly`, `parity replay`, `parity audit`) whose every
error must be a ParityError (exit 2 without the "unexpected error" pointer to --verbose). The
values are drawn around each field's domain: right types with bad values, wrong types, and valid
input (which must succeed), all small, so a valid example samples a few tokens only. Sized by the
hypothesis profile (ci: 25 examples per entry point).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import parity
import parity.nightly.command
import parity.rollouts.command
from parity.backends import Backend, close_shared_backend
from parity.cli import main
from parity.core.errors import ParityError
from parity.core.types import Request, Rollout, SamplingParams
from parity.engine import train_forward
from parity.loop.record import LoopRecord
from parity.report.document import ParityReport
from parity.rollouts.dumps import load_rollouts
from parity.rollouts.record import read_record, write_record
from parity.workload.cases import Case, load_case

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama"

#: values of every type a config or data field could be given by mistake.
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 2**40), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.lists(st.integers(-2, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-1, 2), max_size=2),
)
#: token ids around the tiny vocabulary [0, 512): negative, valid, outside.
TOKEN = st.one_of(st.integers(-2, 520), st.sampled_from([2**31, 10**20]), JUNK)
IDS = st.one_of(st.lists(st.integers(3, 300), min_size=1, max_size=5), st.lists(TOKEN, max_size=5), JUNK)
#: a small value for a sampling field: in and around its domain, small enough to run in a blink.
SMALL = st.one_of(st.integers(-2, 4), st.floats(-1.0, 2.5), st.sampled_from([math.nan, math.inf]),
                  st.booleans(), st.text(max_size=3), st.none(), st.lists(st.integers(-1, 600), max_size=3))
SAMPLING_FIELDS = ["n", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids",
                   "ignore_eos", "logprobs_mode"]
VALID_SAMPLING = st.builds(SamplingParams, n=st.integers(1, 2), temperature=st.sampled_from([0.0, 0.7, 1.0]),
                           top_k=st.integers(0, 5), max_tokens=st.integers(1, 3), seed=st.integers(0, 9))
SAMPLING = st.one_of(
    st.none(), JUNK, VALID_SAMPLING,
    st.dictionaries(st.sampled_from([*SAMPLING_FIELDS, "bogus"]),
                    st.one_of(SMALL, st.sampled_from(["raw", "processed"])), max_size=4),
)


def toml_value(value: Any) -> str:
    """`value` written as TOML (inline tables for dicts; mixed arrays are valid TOML 1.0)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise AssertionError(value)


TOML_SCALAR = st.one_of(st.booleans(), st.integers(-3, 700), st.floats(-2, 3), st.text(max_size=6))
TOML_JUNK = st.one_of(TOML_SCALAR, st.lists(TOML_SCALAR, max_size=3),
                      st.dictionaries(st.text(max_size=3), TOML_SCALAR, max_size=2))
LENGTH = st.one_of(
    st.integers(-1, 8),
    st.fixed_dictionaries({"min": st.integers(0, 6), "max": st.integers(0, 9)}),
    st.fixed_dictionaries({"distribution": st.just("lognormal"), "median": st.floats(0, 1e300),
                           "sigma": st.floats(0, 50), "min": st.integers(1, 4), "max": st.integers(1, 9)}),
    TOML_JUNK,
)
PROMPTS = st.one_of(
    st.fixed_dictionaries({"token_ids": st.one_of(st.lists(st.lists(st.integers(-1, 600), max_size=4),
                                                           max_size=3), TOML_JUNK)}),
    st.fixed_dictionaries({"text": st.one_of(st.lists(st.text(max_size=8), max_size=2), TOML_JUNK)}),
    st.fixed_dictionaries({"generate": st.fixed_dictionaries(
        {"kind": st.sampled_from(["random", "shared_prefix", "zipf"])},
        optional={"count": st.integers(-1, 3), "length": LENGTH, "seed": st.integers(-1, 5),
                  "conversations": st.integers(0, 2), "turns": st.integers(0, 2), "prefix_length": LENGTH,
                  "turn_length": LENGTH, "token_range": st.lists(st.integers(-1, 900), max_size=3)})}),
    TOML_JUNK,
)
CASE = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), TOML_JUNK)},
    optional={
        "prompts": PROMPTS,
        "sampling": st.one_of(st.dictionaries(st.sampled_from([*SAMPLING_FIELDS[:-1], "label", "bogus"]),
                                              TOML_JUNK, max_size=4),
                              st.lists(st.dictionaries(st.sampled_from(["temperature", "label", "top_k"]),
                                                       TOML_JUNK, max_size=2), max_size=2), TOML_JUNK),
        "dtypes": st.one_of(st.lists(st.sampled_from(["bfloat16", "float32", "fp8"]), max_size=3), TOML_JUNK),
        "backends": st.one_of(st.lists(st.sampled_from(["reference", "hf", "tgi"]), max_size=2), TOML_JUNK),
        "logprobs_mode": st.one_of(st.sampled_from(["raw", "processed"]), TOML_JUNK),
        "router_replay": st.one_of(st.lists(st.sampled_from(["none", "R3", "R9"]), max_size=2), TOML_JUNK),
        "tolerance": st.one_of(
            st.dictionaries(st.sampled_from(["max_abs_logprob_diff", "k3_kl_max", "hf", "x"]), TOML_JUNK,
                            max_size=2),
            TOML_JUNK),
        "kind": st.one_of(st.sampled_from(["compare", "lifecycle"]), TOML_JUNK),
        "name": TOML_JUNK, "description": TOML_JUNK, "bogus": TOML_JUNK,
    },
)


def some_broken(valid: dict[str, st.SearchStrategy[Any]],
                broken: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments drawn valid, then 0, 1 or 2 of them replaced by a malformed value: a third
    of the calls are valid and must succeed, the rest fail on a field the message must name."""
    @st.composite
    def draw(draw_from: st.DrawFn) -> dict[str, Any]:
        kwargs = {name: draw_from(strategy) for name, strategy in valid.items()}
        for name in draw_from(st.lists(st.sampled_from(sorted(broken)), max_size=2, unique=True)):
            kwargs[name] = draw_from(broken[name])
        return kwargs
    return draw()


def never_anything_but_a_parity_error(call: Any) -> Any:
    """call() or its ParityError; any other exception fails the test (with the exception)."""
    try:
        return call()
    except ParityError as exc:
        return exc


@pytest.fixture(scope="module", autouse=True)
def _engines_closed():
    yield
    for dtype in ("bfloat16", "float32"):  # the engines test_compare's draws start (other modules' stay up)
        close_shared_backend("reference", MODEL, dtype=dtype)


#: values that are no LoRA adapter: junk, an empty or missing path, an unknown built-in name, a
#: directory without adapter files.
LORA = st.one_of(JUNK, st.sampled_from(["", "/no/such/adapter", "tiny-llama-lora-r9", "tests"]))


VALID_PROMPTS = st.lists(
    st.one_of(st.lists(st.integers(3, 300), min_size=1, max_size=4), st.text("ab ", max_size=4)),
    min_size=1, max_size=2)


@given(kwargs=some_broken(
    valid={
        "prompts": VALID_PROMPTS,
        "sampling": VALID_SAMPLING,
        "dtype": st.sampled_from([None, "float32"]),
        "tolerance": st.none(),
        "reference": st.sampled_from(["invariant", "native"]),
        "router_replay": st.sampled_from([None, "none"]),
        "device": st.just("cpu"),
        "backend": st.just("reference"),
        "correction": st.sampled_from([None, {"rollout_is": "sequence", "rollout_is_threshold": "0.5_2.0"},
                                       {"rollout_rs": "token_k1", "rollout_rs_threshold": 2.0}]),
        "lora": st.sampled_from([None, "tiny-llama-lora-r8"]),
    },
    broken={
        "prompts": st.one_of(JUNK, st.lists(st.one_of(IDS, st.text(max_size=6)), max_size=3)),
        "sampling": SAMPLING,
        "dtype": st.sampled_from(["float64", 3, "bf16"]),
        "tolerance": st.one_of(JUNK, st.dictionaries(st.sampled_from(["max_abs_logprob_diff", "x"]), SMALL,
                                                     max_size=2)),
        "reference": st.sampled_from(["fast", None, 1]),
        "router_replay": st.sampled_from(["R3", "R9", 1]),
        "device": st.sampled_from(["bogus", "cuda:99", None, 0]),
        "backend": st.sampled_from(["nope", 7, None]),
        "correction": st.one_of(JUNK, st.dictionaries(
            st.sampled_from(["rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold",
                             "x"]),
            st.one_of(SMALL, st.sampled_from(["token", "seq_mean_k3", "0.5_2.0", "2_1"])), max_size=3)),
        "lora": LORA,
    }))
@pytest.mark.slow
def test_compare(kwargs):
    model, backend = MODEL, kwargs.pop("backend")
    result = never_anything_but_a_parity_error(lambda: parity.compare(model, backend, **kwargs))
    assert isinstance(result, (ParityReport, ParityError))


#: a small [batch, response_len] step: float32 logprobs <= 0 and a mask with a valid token.
_STEP_SHAPE = (3, 4)
LOGPROBS = st.lists(st.lists(st.floats(-8.0, 0.0, width=32), min_size=4, max_size=4), min_size=3, max_size=3)
MASK = st.lists(st.lists(st.sampled_from([0, 1]), min_size=4, max_size=4), min_size=3, max_size=3).filter(
    lambda m: any(map(any, m)))
#: malformed arrays: wrong shapes, NaN, +inf, masks of other values or none set, not arrays at all.
BAD_ARRAY = st.one_of(JUNK, st.lists(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=5),
                                     max_size=4),
                      st.lists(st.lists(st.sampled_from([0, 2, -1, 0.5]), min_size=4, max_size=4), min_size=3,
                               max_size=3))


@given(kwargs=some_broken(
    valid={"rollout_log_probs": LOGPROBS, "old_log_probs": LOGPROBS, "response_mask": MASK,
           "responses": st.none(), "prompts": st.none(), "sampling": st.none(), "meta": st.none(),
           "step": st.just(0)},
    broken={"rollout_log_probs": BAD_ARRAY, "old_log_probs": BAD_ARRAY, "response_mask": BAD_ARRAY,
            "responses": st.one_of(JUNK, BAD_ARRAY), "prompts": st.one_of(JUNK, BAD_ARRAY),
            "sampling": SAMPLING, "meta": JUNK, "step": st.one_of(JUNK, st.integers(-5, -1))}))
@pytest.mark.slow
def test_monitor_log(tmp_path_factory, kwargs):
    """`Monitor.log` (and so verl's `log_batch`): success or a ParityError, and a failed log
    stores nothing."""
    out = tmp_path_factory.mktemp("monitor")
    with parity.Monitor(out, advice_every=0, render_every=0) as monitor:
        step = kwargs.pop("step")
        result = never_anything_but_a_parity_error(lambda: monitor.log(step, **kwargs))
        stored = monitor.last_step
    assert isinstance(result, (dict, ParityError))
    assert (stored is None) == isinstance(result, ParityError)


VALID_PAIRS = st.lists(st.tuples(st.lists(st.integers(3, 300), min_size=1, max_size=4),
                                 st.lists(st.integers(3, 300), max_size=3)), min_size=1, max_size=3)


@given(kwargs=some_broken(
    valid={
        "sequences": VALID_PAIRS,
        "temperature": st.sampled_from([0.0, 0.7, 1.0]),
        "top_k": st.integers(0, 5),
        "top_p": st.sampled_from([0.5, 1.0]),
        "kernels": st.sampled_from(["invariant", "native", ["matmul"]]),
        "layout": st.sampled_from(["right", "left", "packed"]),
        "micro_batch_size": st.sampled_from([None, 1, 2]),
        "logprobs_mode": st.sampled_from([None, "raw", "processed"]),
        "dtype": st.just("float32"),
        "lora": st.sampled_from([None, "tiny-llama-lora-r8"]),
    },
    broken={
        "sequences": st.one_of(JUNK, st.lists(st.one_of(st.tuples(IDS, IDS), st.lists(IDS, max_size=3), JUNK),
                                              max_size=3)),
        "temperature": st.one_of(SMALL, st.lists(SMALL, max_size=3)),
        "top_k": SMALL,
        "top_p": SMALL,
        "kernels": st.sampled_from([["x"], 3, None, "fast"]),
        "layout": st.sampled_from(["diagonal", 1]),
        "micro_batch_size": SMALL,
        "logprobs_mode": st.sampled_from(["x", 1]),
        "dtype": st.sampled_from(["float64", None]),
        "lora": LORA,
    }))
@pytest.mark.slow
def test_train_forward(kwargs):
    sequences = kwargs.pop("sequences")
    never_anything_but_a_parity_error(lambda: train_forward(MODEL, sequences, **kwargs))


@given(kwargs=some_broken(
    valid={
        "steps": st.integers(1, 2), "prompts": st.integers(1, 2), "n": st.integers(1, 2),
        "max_tokens": st.integers(1, 3), "lr": st.sampled_from([1e-4, 1e-2]), "seed": st.integers(0, 9),
        "correction": st.sampled_from(["none", "token_tis", "icepop:0.5_2", "seq_mean_k3:0.5"]),
        "micro_batch_size": st.sampled_from([None, 1]), "temperature": st.sampled_from([0.5, 1.0]),
    },
    broken={
        "steps": SMALL, "prompts": SMALL, "n": SMALL, "max_tokens": SMALL, "lr": SMALL, "seed": SMALL,
        "correction": st.one_of(JUNK, st.sampled_from(["tis", "token_tis:x", "icepop:2", "seq_mean_k3"])),
        "micro_batch_size": SMALL, "temperature": SMALL, "backends": st.one_of(JUNK, st.just(["hf"])),
        "train_on": JUNK, "dtype": JUNK, "device": st.sampled_from(["bogus", "cuda:99", 0]),
        "backend_dtypes": st.one_of(JUNK, st.just({"reference": "fp8"})),
        "backend_options": st.one_of(JUNK, st.just({"reference": {"bogus": 1}})),
        "grad_clip": SMALL, "weight_decay": SMALL,
    }))
@pytest.mark.usefixtures("one_thread")
def test_loop(kwargs):
    result = never_anything_but_a_parity_error(lambda: parity.loop(MODEL, **kwargs))
    assert isinstance(result, (LoopRecord, ParityError))


@given(case=CASE, garbage=st.one_of(st.just(""), st.text(max_size=10)))
def test_load_case(tmp_path_factory, case, garbage):
    path = tmp_path_factory.mktemp("case") / "case.toml"
    path.write_text("".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in case.items()) + garbage)
    result = never_anything_but_a_parity_error(lambda: load_case(path))
    assert isinstance(result, (Case, ParityError))


ROW_KEYS = ["prompt_ids", "prompts", "response_ids", "responses", "token_ids", "rollout_logprobs", "logprobs",
            "rollout_log_probs", "request_id", "sample_index", "finish_reason", "logprobs_mode",
            "routed_experts", "response_mask"]
LOGPROBS = st.one_of(st.lists(st.one_of(st.floats(-20, 1), st.just(math.nan)), max_size=5), JUNK)
ROW = st.fixed_dictionaries(
    {"prompt_ids": IDS, "response_ids": IDS, "rollout_logprobs": LOGPROBS},
    optional={k: st.one_of(IDS, LOGPROBS, JUNK, st.lists(st.lists(st.lists(st.integers(0, 3), max_size=2),
                                                                    max_size=2), max_size=3))
              for k in ROW_KEYS if k not in ("prompt_ids", "response_ids", "rollout_logprobs")})


@given(rows=st.lists(st.one_of(ROW, JUNK), max_size=4), garbage=st.sampled_from(["", "{not json\n", "[1]\n"]))
def test_load_rollouts(tmp_path_factory, rows, garbage):
    path = tmp_path_factory.mktemp("dump") / "dump.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + garbage)
    result = never_anything_but_a_parity_error(lambda: load_rollouts(path))
    assert isinstance(result, (list, ParityError))


REQUESTS = [Request((3, 4, 5), SamplingParams(n=2, max_tokens=3, seed=1), "a"),
            Request((6, 7), request_id="b")]
ROLLOUTS = [Rollout("a", 0, (3, 4, 5), (8, 9), (-0.5, -1.0), "length", "hf")]


@given(edits=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["kind", "format", "version", "request_id",
                                                                    "prompt_ids", "sampling", "sample_index",
                                                                    "token_ids", "logprobs", "routed_experts",
                                                                    "meta", "finish_reason", "backend"]),
                                st.one_of(JUNK, IDS, st.just("<drop>"))), max_size=3),
       extra=st.sampled_from(["", "{}\n", "[]\n", "{oops\n", '{"kind": "request"}\n']))
def test_read_record(tmp_path_factory, edits, extra):
    path = write_record(tmp_path_factory.mktemp("rec") / "r.jsonl", REQUESTS, ROLLOUTS, model=MODEL)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for index, key, value in edits:
        if value == "<drop>":
            lines[index].pop(key, None)
        else:
            lines[index][key] = value
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + extra)
    never_anything_but_a_parity_error(lambda: read_record(path))


class Stop(ParityError):
    """Raised where the work would start: the command got that far on its checks."""


def stop(*args: Any, **kwargs: Any) -> None:
    raise Stop("stopped where the work starts")


OPTION_VALUES = {
    "--model": [MODEL, "nope", "", "/"],
    "--backend": ["reference", "hf", "nope", "sglang"],
    "--case": [str(ROOT / "cases" / "smoke.toml"), "missing.toml", ""],
    "--dtype": ["float32", "fp8"],
    "--reference": ["native", "fast"],
    "--router-replay": ["R3", "none", "x"],
    "--attribute": ["batch", "x"],
    "--device": ["cpu", "bogus", "cuda:99"],
    "--option": ["record_routes=true", "x", "=1", "foo=1", "chunk_size=[1"],
    "--worst": ["3", "-1", "x"],
    "--json": ["{tmp}/r.json", "{tmp}"],
    "--html": ["{tmp}/x/r.html", "/proc/x.html"],
}
AUDIT_VALUES = {
    "--model": [MODEL, "nope", ""],
    "--backend": ["reference", "nope", "sglang"],
    "--case": [str(ROOT / "cases" / "audit.toml"), "missing.toml", "smoke", ""],
    "--dtype": ["float32", "fp8"],
    "--device": ["cpu", "bogus", "cuda:99"],
    "--option": ["record_routes=true", "x", "foo=1"],
    "--checks": ["repeat,seed", "x", ",", "batch"],
    "--batch-sizes": ["1,8,64", "1,2", "8,64", "x", "1,0,3"],
    "--json": ["{tmp}/a.json", "{tmp}"],
    "--html": ["{tmp}/x/a.html", "/proc/x.html"],
}
NIGHTLY_VALUES = {
    "--cases": [str(ROOT / "cases" / "smoke.toml"), "nope", ","],
    "--backends": ["auto", "hf,vllm", "tgi", ""],
    "--dtypes": ["float32", "fp8", ","],
    "--out": ["{tmp}/o", "/proc/o"],
    "--history": ["{tmp}/h.sqlite", "{tmp}"],
    "--run-id": ["r1", "../x", ""],
    "--resume": ["r1", "ghost", "-"],
    "--baseline": ["b", "../b"],
    "--alpha": ["0.5", "2", "x", "nan"],
    "--min-effect": ["-1", "0.1", "inf"],
    "--reference": ["native", "x"],
}


def argv_from(options: dict[str, list[str]]) -> st.SearchStrategy[list[str]]:
    """Command lines of up to five options, each with a value from `options` (or a stray token)."""
    pair = st.sampled_from(sorted(options)).flatmap(
        lambda option: st.sampled_from(options[option]).map(lambda value: [option, value]))
    stray = st.sampled_from([["--bogus"], ["x"], ["--no-progress"]])
    return st.lists(st.one_of(pair, stray), max_size=5).map(lambda pairs: [t for p in pairs for t in p])


def assert_a_parity_error_or_success(code: int | None, capsys: pytest.CaptureFixture[str]) -> None:
    err = capsys.readouterr().err
    assert code in (0, 1, 2), code
    assert "run with --verbose for the traceback" not in err and "Traceback" not in err, err


def test_command_line(tmp_path_factory, capsys):
    tmp = str(tmp_path_factory.mktemp("cli"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("parity.backends.reference.ReferenceBackend.generate", stop)
        mp.setattr(sys.modules["parity.nightly.command"], "run_nightly", stop)
        mp.setattr(sys.modules["parity.rollouts.command"], "get_backend", stop)

        @given(command=st.sampled_from(["compare", "nightly", "replay", "audit"]),
               compare=argv_from(OPTION_VALUES), nightly=argv_from(NIGHTLY_VALUES),
               audit=argv_from(AUDIT_VALUES), record=st.sampled_from(["rec", "missing", ""]))
        def run(command: str, compare: list[str], nightly: list[str], audit: list[str], record: str) -> None:
            argv = {"compare": ["compare", *compare], "nightly": ["nightly", *nightly],
                    "audit": ["audit", *audit],
                    "replay": ["replay", record and f"{tmp}/{record}.jsonl", *compare[:4]]}[command]
            argv = [a.replace("{tmp}", tmp) for a in argv]
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse: exit 2 on a usage error, 0 for --help
                code = exc.code
            assert_a_parity_error_or_success(code, capsys)

        write_record(Path(tmp) / "rec.jsonl", REQUESTS, model=MODEL)
        run()


SAMPLING_OBJECT = st.dictionaries(st.sampled_from(["temperature", "top_p", "top_k", "n", "bogus"]), SMALL,
                                  max_size=3)
CONTRADICTING_ROW = st.fixed_dictionaries(
    {"prompt_ids": st.lists(st.integers(3, 300), min_size=1, max_size=4),
     "response_ids": st.lists(st.integers(0, 300), min_size=1, max_size=4),
     "rollout_logprobs": st.lists(
         st.one_of(st.floats(-5, 0.5), st.sampled_from(["-inf", "nan", -math.inf])), min_size=1, max_size=4)},
    optional={"sampling": st.one_of(SAMPLING_OBJECT, JUNK), "temperature": SMALL, "top_p": SMALL,
              "top_k": SMALL, "old_log_probs": LOGPROBS,
              "response_mask": st.lists(st.integers(0, 1), max_size=4),
              "attention_mask": st.lists(st.integers(0, 1), max_size=8)})


@given(rows=st.lists(CONTRADICTING_ROW, min_size=1, max_size=3))
def test_dumps_whose_columns_contradict(tmp_path_factory, rows):
    """Sampling objects beside flat columns, padding, masks and non-finite logprobs in any mix."""
    path = tmp_path_factory.mktemp("dump") / "dump.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = never_anything_but_a_parity_error(lambda: load_rollouts(path, sampling=SamplingParams()))
    assert isinstance(result, (list, ParityError))


class Answering(Backend):
    """Answers every request with the generated rollout fields, whatever they are."""

    name = "answering"

    def __init__(self, model, *, dtype="float32", fields=None) -> None:
        super().__init__(model, dtype=dtype)
        self.fields = fields or {}

    def generate(self, requests):
        return [Rollout(**{"request_id": r.request_id, "sample_index": i, "prompt_ids": r.prompt_ids,
                           "token_ids": (5, 6), "logprobs": (-0.5, -1.0), "finish_reason": "length",
                           "backend": self.name, "sampling": r.sampling, **self.fields})
                for r in requests for i in range(r.sampling.n)]

    def _score(self, pairs, sampling):
        raise NotImplementedError

    def close(self) -> None:
        pass


ODD_LOGPROBS = st.lists(st.sampled_from([-math.inf, math.inf, 3.0, -0.1]), min_size=2, max_size=2)
ANSWER = st.fixed_dictionaries({}, optional={
    "token_ids": IDS, "logprobs": st.one_of(LOGPROBS, ODD_LOGPROBS),
    "prompt_ids": IDS, "sample_index": st.integers(-1, 3),
    "request_id": st.sampled_from(["prompt-0", "ghost"])})


@given(fields=ANSWER)
def test_backend_answers(fields):
    """Whatever a backend answers, compare reports it or refuses it with the request named."""
    def run():
        backend = Answering(MODEL, fields=fields)  # an answer that forms no Rollout is refused here
        return parity.compare(MODEL, backend, prompts=[[3, 4, 5]], sampling={"max_tokens": 3},
                              dtype="float32")
    result = never_anything_but_a_parity_error(run)
    assert isinstance(result, (ParityReport, ParityError))
