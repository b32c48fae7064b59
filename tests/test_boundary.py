"""Bad input stops at the boundary with a `ParityError` naming the field, before any engine sees it:
prompt ids against the model's vocabulary and context, strict types of every config value,
unique request ids, rollout dumps (empty files, response masks) and hostile text in summary.md.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from markdown_it import MarkdownIt

import parity
from parity.backends import Backend
from parity.core.errors import BackendError, ConfigError, InputError, ParityError
from parity.core.types import Request, Rollout, SamplingParams
from parity.correction import CorrectionConfig
from parity.drift.tolerance import Tolerance
from parity.engine import EngineConfig
from parity.models import resolve_model
from parity.nightly.history import RunInfo
from parity.nightly.markdown_report import render_summary
from parity.nightly.regression import RegressionPolicy
from parity.nightly.rows import RowKey, RowResult
from parity.nightly.runner import NightlyConfig
from parity.rollouts.dumps import load_rollouts
from parity.rollouts.matching import match_requests
from parity.rollouts.record import read_record, replay, write_record
from parity.workload.cases import Case, load_case

#: the built-in checkpoints' vocabulary and context (parity.models.checkpoints).
VOCAB, CONTEXT = 512, 512


def write(tmp_path: Path, body: str, name: str = "case.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture
def no_engine(monkeypatch):
    """Any engine start fails the test: the error must come before it."""
    def started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an engine was started before the input was checked")
    monkeypatch.setattr(sys.modules["parity.compare"], "shared_backend", started)


# -- prompt ids against the model's vocabulary and context --------------------------------------


def test_model_limits_come_from_config_json_without_loading_the_model():
    from parity.models import model_limits

    limits = model_limits("tiny-llama")
    assert (limits.vocab_size, limits.max_positions) == (VOCAB, CONTEXT)


@pytest.mark.parametrize(("body", "match"), [
    ("[prompts]\ntoken_ids = [[3, 4], [5, 512]]", r"request '1'.*token id 512.*vocabulary of 512"),
    ("[prompts.generate]\nkind = 'random'\ncount = 2\nlength = 4\ntoken_range = [3, 900]",
     r"token id \d+.*vocabulary of 512"),
    ("[prompts]\ntoken_ids = [[3, 4]]\n[sampling]\nstop_token_ids = [7, 512]",
     r"sampling\.stop_token_ids: has token id 512.*vocabulary of 512"),
    ("[prompts]\ntoken_ids = [[3, 4]]\n[sampling]\nmax_tokens = 511", r"needs 2 prompt \+ 511 generated"),
])
def test_a_case_with_ids_the_model_cannot_take_is_refused_when_loaded(tmp_path, body, match):
    path = write(tmp_path, 'model = "tiny-llama"\n' + body)
    with pytest.raises(ConfigError, match=match) as info:
        load_case(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("backend", ["reference", "hf", "vllm"])
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"prompts": [[3, 4], [5, VOCAB]]}, r"prompts\[1\].*token id 512.*vocabulary of 512"),
    ({"prompts": [[3] * 500], "sampling": SamplingParams(max_tokens=13)},
     r"prompts\[0\] needs 500 prompt \+ 13 generated = 513 positions; the model allows 512"),
    ({"prompts": [[3, 4]], "sampling": SamplingParams(stop_token_ids=(600,))}, r"stop_token_ids.*600"),
])
def test_compare_checks_prompts_against_the_model_before_any_engine(no_engine, backend, kwargs, match):
    with pytest.raises(InputError, match=match):
        parity.compare("tiny-llama", backend, **kwargs)


@pytest.mark.parametrize(("correction", "match"), [
    ({"rollout_is": "tokens"}, "rollout_is must be"),
    ({"rollout_is_treshold": 2.0}, r"unknown option\(s\) \['rollout_is_treshold'\]"),
    ("token", "correction must be a table"),
])
def test_compare_checks_the_correction_before_any_engine(no_engine, correction, match):
    with pytest.raises(ConfigError, match=match):
        parity.compare("tiny-llama", "hf", prompts=[[3, 4]], correction=correction)


def test_compare_checks_a_case_object_against_the_model_it_runs(no_engine):
    case = Case(name="c", model="tiny-llama", requests=(Request((3, VOCAB + 7), request_id="x"),))
    with pytest.raises(InputError, match=r"case 'c': request 'x'.*token id 519"):
        parity.compare(None, "hf", case=case)


def test_replay_checks_the_records_requests_against_the_backends_model(tmp_path):
    class Refuses(Backend):
        name = "refuses"

        def generate(self, requests):
            raise AssertionError("the backend saw an out-of-vocabulary id")

        def _score(self, pairs, sampling):
            raise AssertionError

        def close(self) -> None:
            pass

    path = write_record(tmp_path / "r.jsonl", [Request((3, 4, 2000), request_id="a")], model="tiny-llama")
    with pytest.raises(InputError, match=r"request 'a'.*token id 2000"):
        replay(read_record(path), Refuses("tiny-llama", dtype="float32"))


def test_a_broken_config_json_or_a_checkpoint_without_weights_is_a_config_error(tmp_path):
    from parity.models import model_limits

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"config.json.*not valid JSON"):
        model_limits(broken)
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text((resolve_model("tiny-llama") / "config.json").read_text())
    with pytest.raises(ParityError, match=r"no weights.*safetensors"):
        resolve_model(empty)


# -- strict types -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("ignore_eos", "false"), ("ignore_eos", 0), ("n", True), ("n", 2.0), ("top_k", False), ("top_k", 1.5),
    ("max_tokens", "8"), ("seed", True), ("seed", 1.0), ("temperature", True), ("temperature", "0.7"),
    ("top_p", True), ("stop_token_ids", "12"), ("stop_token_ids", 12), ("stop_token_ids", [True]),
    ("stop_token_ids", [1.5]), ("stop_token_ids", ["3"]), ("stop_token_ids", [-1]),
    ("logprobs_mode", 1), ("logprobs_mode", ["raw"]),
])
def test_sampling_params_refuse_a_wrong_type_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"sampling\.{field}"):
        SamplingParams(**{field: value})
    with pytest.raises(ConfigError, match=rf"sampling\.{field}"):
        SamplingParams.from_dict({field: value})


def test_sampling_params_take_numpy_numbers_as_plain_python_ones():
    s = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), stop_token_ids=np.array([7, 9]),
                       ignore_eos=np.bool_(True))
    assert (s.n, s.stop_token_ids, s.ignore_eos) == (2, (7, 9), True)
    assert type(s.n) is int and type(s.ignore_eos) is bool and all(type(t) is int for t in s.stop_token_ids)
    assert json.dumps(s.to_dict())  # plain types all the way down


@pytest.mark.parametrize(("line", "field"), [
    ('ignore_eos = "false"', "ignore_eos"), ("n = true", "n"), ('stop_token_ids = "12"', "stop_token_ids"),
    ("temperature = true", "temperature"),
])
def test_a_case_file_with_a_wrongly_typed_sampling_field_is_refused(tmp_path, line, field):
    path = write(tmp_path, f'model = "tiny-llama"\n[prompts]\ntoken_ids = [[3, 4]]\n[sampling]\n{line}\n')
    with pytest.raises(ConfigError, match=rf"sampling.*{field}"):
        load_case(path)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: Request(("3", "4")), "prompt_ids"),
    (lambda: Request((3.7, 4)), "prompt_ids"),
    (lambda: Request((3, True)), "prompt_ids"),
    (lambda: Request([3, 4], request_id=None), "request_id"),
    (lambda: Request([3, 4], request_id=1.5), "request_id"),
    (lambda: Request("34"), "prompt_ids"),
    (lambda: Rollout("a", 0, (1,), (2.5,), (-0.1,), "stop", "x"), "token_ids"),
    (lambda: Rollout("a", 0, (1,), (2,), ("-0.1",), "stop", "x"), "logprobs"),
    (lambda: Rollout("a", -1, (1,), (2,), (-0.1,), "stop", "x"), "sample_index"),
    (lambda: Rollout("a", True, (1,), (2,), (-0.1,), "stop", "x"), "sample_index"),
    (lambda: Rollout("a", 0, (1,), (2,), (-0.1,), 3, "x"), "finish_reason"),
    (lambda: Rollout.from_dict({"request_id": "a", "sample_index": "0", "prompt_ids": [1], "token_ids": [2],
                                "logprobs": [-0.1], "finish_reason": "stop", "backend": "x"}),
     "sample_index"),
    (lambda: Tolerance.from_dict([("max_abs_logprob_diff", 1.0)]), "tolerance must be a table"),
    (lambda: Tolerance(k3_kl_max="0.1"), "k3_kl_max"),
    (lambda: RegressionPolicy(alpha="0.01"), "alpha"),
    (lambda: RegressionPolicy(min_effect=True), "min-effect"),
    (lambda: Case(name=3, model="tiny-llama", requests=(Request((3,)),)), "name"),
    (lambda: Case(name="c", model="tiny-llama", requests=[(3, 4)]), "requests"),
    (lambda: Case(name="c", model="tiny-llama", requests=(Request((3,)),), dtypes="bfloat16"), "dtypes"),
    (lambda: NightlyConfig(cases=["cases/smoke.toml"]), "--cases"),
    (lambda: NightlyConfig(cases="c", backends="hf"), "--backends"),
    (lambda: NightlyConfig(cases="c", out=3), "--out"),
    (lambda: NightlyConfig(cases="c", run_id=7), "--run-id"),
    (lambda: NightlyConfig(cases="c", policy={"alpha": 0.1}), "policy"),
    (lambda: EngineConfig(dtype="float64"), "dtype"),
    (lambda: EngineConfig(dtype=None), "dtype"),
    (lambda: EngineConfig(device="bogus"), "device 'bogus'"),
    (lambda: EngineConfig(kernels=3), "kernels"),
    (lambda: EngineConfig(kernels=[1, "attention"]), "kernels"),
    (lambda: EngineConfig(kernels=None), "kernels"),
    (lambda: EngineConfig(kernels=[["attention"]]), "kernels"),
    (lambda: EngineConfig(lora=3), "lora"),
    (lambda: EngineConfig(lora="tiny-llama-lora-r8", tensor_parallel_size=2), "tensor parallelism"),
    (lambda: NightlyConfig(cases="c", lora=["a"]), "--lora"),
    (lambda: Case(name="c", model="tiny-llama", requests=(Request((3,)),), lora=5), "lora"),
    (lambda: CorrectionConfig.from_dict([("rollout_is", "token")]), "correction must be a table"),
    (lambda: CorrectionConfig(rollout_is=["token"]), "rollout_is"),
])
def test_config_types_refuse_wrong_types_naming_the_field(make, match):
    with pytest.raises(ParityError, match=match):
        make()


# -- unique request ids ----------------------------------------------------------------------------


def hot_and_cold(rid_b: str = "a") -> tuple[Request, Request]:
    return (Request((3, 4, 5), SamplingParams(temperature=0.5, max_tokens=4), request_id="a"),
            Request((6, 7), SamplingParams(temperature=1.5, max_tokens=4), request_id=rid_b))


def test_a_case_refuses_repeated_request_ids():
    with pytest.raises(ConfigError, match=r"request_id.*'a'.*more than once"):
        Case(name="dup", model="tiny-llama", requests=hot_and_cold())


def test_matching_rollouts_to_requests_refuses_repeated_request_ids():
    """A rollout takes its request's sampling by request id: two requests under one id would score
    one of them under the other's temperature (1.07 nats of fake drift on the exact reference)."""
    with pytest.raises(InputError, match=r"request_id.*'a'"):
        match_requests([], list(hot_and_cold()))


class Echo(Backend):
    """A backend that returns each sample `copies` times (a buggy adapter or server)."""

    name = "echo"

    def __init__(self, model: str, *, copies: int = 2, dtype: str = "float32") -> None:
        super().__init__(model, dtype=dtype)
        self.copies = copies

    def generate(self, requests):
        return [Rollout(r.request_id, 0, r.prompt_ids, (5,), (-0.5,), "length", self.name)
                for r in requests for _ in range(self.copies)]

    def _score(self, pairs, sampling):
        raise AssertionError

    def close(self) -> None:
        pass


def test_compare_refuses_a_backend_that_returns_a_sample_twice():
    with pytest.raises(BackendError, match=r"'echo' returned sample \('prompt-0', 0\) more than once"):
        parity.compare("tiny-llama", Echo("tiny-llama"), prompts=[[3, 4]], dtype="float32",
                       sampling=SamplingParams(max_tokens=1))


def test_compare_refuses_a_backend_that_leaves_a_sample_out():
    with pytest.raises(BackendError, match=r"returned 0 of 1 samples; missing \('prompt-0', 0\)"):
        parity.compare("tiny-llama", Echo("tiny-llama", copies=0), prompts=[[3, 4]], dtype="float32",
                       sampling=SamplingParams(max_tokens=1))


def test_records_refuse_repeated_request_ids_and_samples(tmp_path):
    with pytest.raises(InputError, match=r"request_id.*'a'"):
        write_record(tmp_path / "w.jsonl", hot_and_cold())
    good = write_record(tmp_path / "r.jsonl", hot_and_cold("b"))
    lines = good.read_text().splitlines()
    (tmp_path / "dup.jsonl").write_text("\n".join([*lines, lines[1]]) + "\n")
    with pytest.raises(InputError, match=r"dup.jsonl:4: request_id 'a' appears more than once"):
        read_record(tmp_path / "dup.jsonl")
    rollout = Rollout("a", 0, (3, 4, 5), (6,), (-0.1,), "stop", "hf")
    rollout = json.dumps({"kind": "rollout", **rollout.to_dict()})
    (tmp_path / "dup2.jsonl").write_text("\n".join([*lines, rollout, rollout]) + "\n")
    with pytest.raises(InputError, match=r"dup2.jsonl:5: rollout \('a', 0\) of backend 'hf' appears more"):
        read_record(tmp_path / "dup2.jsonl")


ROW = {"prompt_ids": [1, 2], "response_ids": [3, 4], "rollout_logprobs": [-0.1, -0.2], "logprobs_mode": "raw"}


def dump(tmp_path: Path, *rows: dict[str, Any]) -> Path:
    path = tmp_path / "dump.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_ingestion_refuses_one_request_id_with_two_prompts(tmp_path):
    path = dump(tmp_path, {**ROW, "request_id": "q", "sample_index": 0},
                {**ROW, "request_id": "q", "sample_index": 1, "prompt_ids": [1, 9]})
    with pytest.raises(InputError, match=r"dump.jsonl:2: request_id 'q'.*other prompt"):
        load_rollouts(path)
    with pytest.raises(InputError, match=r"repeats"):
        load_rollouts(dump(tmp_path, {**ROW, "request_id": "q", "sample_index": 0},
                           {**ROW, "request_id": "q", "sample_index": 0}))


# -- rollout dumps ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_empty_dump_is_an_error(tmp_path, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(InputError, match=r"empty\.jsonl: no rollouts"):
        load_rollouts(path)


@pytest.mark.parametrize(("mask", "match"), [
    ([1, 2], r"response_mask values must be 0 or 1, got 2"),
    ([1, 0.5], r"response_mask values must be 0 or 1, got 0.5"),
    ([1, "1"], r"response_mask values must be 0 or 1"),
    ([1], r"one entry per response token"),
])
def test_a_response_mask_holds_one_0_or_1_per_token(tmp_path, mask, match):
    response = [3, 4, 5][:max(len(mask), 2)]
    row = {**ROW, "response_ids": response, "rollout_logprobs": [-0.1] * len(response), "response_mask": mask}
    with pytest.raises(InputError, match=match):
        load_rollouts(dump(tmp_path, row))


def test_right_padding_is_still_stripped(tmp_path):
    row = {**ROW, "response_ids": [3, 4, 0], "rollout_logprobs": [-0.1, -0.2, 0.0],
           "response_mask": [1, True, 0.0]}
    assert load_rollouts(dump(tmp_path, row))[0].token_ids == (3, 4)


# -- summary.md lands in CI comments ---------------------------------------------------------------

HOSTILE = ("<img src=x onerror=alert(1)> [click](https://evil.example) @octocat **bold** "
           "`tick` </details> <!-- | ![x](https://evil.example/p.png)")


def test_summary_md_escapes_user_text():
    run = RunInfo("r1", 1, "2025-01-01T00:00:00+00:00", None, {"baseline": None}, {})
    rows = [RowResult("r1", RowKey(HOSTILE, "hf", "bfloat16"), "error", error=f"RuntimeError: {HOSTILE}"),
            RowResult("r1", RowKey("plain", "hf", "bfloat16"), "pass",
                      summary={"max_abs_logprob_diff": 0.1})]
    text = render_summary(run, rows)
    html = MarkdownIt("commonmark").enable("table").render(text)
    for tag in ("<img", "<a ", "</details>", "<!--", "<strong>bold", "<code>tick"):
        assert tag not in html, (tag, html)
    assert "@octocat" not in text  # no mention pings anyone
    assert "onerror=alert(1)" in html.replace("&gt;", ">")  # the text itself is still readable
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len({line.count(" | ") for line in table}) == 1  # the hostile name did not add a cell
