"""The case library and its loader: every shipped case loads, bad files name file, field and choices."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from parity.core.errors import ConfigError, ParityError
from parity.drift.tolerance import Tolerance
from parity.workload.cases import Case, default_case, load_case, load_cases

CASES = Path(__file__).resolve().parent.parent / "cases"
SHIPPED = ("smoke", "moe", "long-prompt", "sampling-sweep", "grpo-group", "shared-prefix", "fp16-vs-bf16",
           "trained-chat", "lifecycle", "multi-turn-tool", "loop", "audit", "lora")

MINIMAL = """
model = "tiny-llama"
[prompts]
token_ids = [[3, 4, 5], [6, 7]]
"""


def write(tmp_path: Path, body: str, name: str = "case.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.slow
def test_every_shipped_case_loads_and_fits_the_tiny_context():
    cases = load_cases(CASES)
    assert sorted(c.name for c in cases) == sorted(SHIPPED)
    for case in cases:
        assert case.description and case.path is not None
        assert all(len(r.prompt_ids) + r.sampling.max_tokens <= 512 for r in case.requests)
        assert len({r.request_id for r in case.requests}) == len(case.requests)


def test_shipped_cases_have_the_promised_shapes():
    by_name = {c.name: c for c in load_cases(CASES)}
    assert by_name["moe"].model == "tiny-qwen3-moe" and by_name["moe"].router_replay == ("none", "R3")
    assert min(len(r.prompt_ids) for r in by_name["long-prompt"].requests) >= 400
    assert {r.sampling.n for r in by_name["grpo-group"].requests} == {8}
    assert by_name["fp16-vs-bf16"].dtypes == ("bfloat16", "float16")
    sweep = by_name["sampling-sweep"].requests
    assert {r.sampling.temperature for r in sweep} == {0.6, 1.0, 1.2}
    assert any(r.sampling.top_p < 1 for r in sweep) and any(r.sampling.top_k for r in sweep)
    assert any(r.sampling.top_p == 1 and r.sampling.top_k == 0 for r in sweep)
    assert sweep[0].request_id == "t0.6/0"
    loop = by_name["loop"]
    assert loop.kind == "loop" and loop.loop_steps == 8 and loop.loop_lr == 3e-3


def test_shared_prefix_prompts_share_the_prefix_and_their_conversation(tmp_path):
    case = load_case(CASES / "shared-prefix.toml")
    prompts = [r.prompt_ids for r in case.requests]
    assert all(p[:192] == prompts[0][:192] for p in prompts)
    # turns of one conversation extend each other; conversations differ after the prefix
    assert prompts[1][:len(prompts[0])] == prompts[0] and prompts[2][:len(prompts[1])] == prompts[1]
    assert prompts[3][:len(prompts[0])] != prompts[0]


def test_generated_prompts_are_deterministic_and_follow_the_length_spec(tmp_path):
    path = write(tmp_path, """
        model = "tiny-llama"
        [prompts.generate]
        kind = "random"
        seed = 7
        count = 20
        length = { distribution = "lognormal", median = 16, sigma = 1.0, min = 5, max = 30 }
        [sampling]
        seed = 100
    """)
    a, b = load_case(path), load_case(path)
    assert a.hash == b.hash and a.requests == b.requests
    assert all(5 <= len(r.prompt_ids) <= 30 for r in a.requests)
    assert all(3 <= t < 259 for r in a.requests for t in r.prompt_ids)
    assert [r.sampling.seed for r in a.requests] == list(range(100, 120))


def test_text_prompts_use_the_model_tokenizer(tmp_path):
    case = load_case(write(tmp_path, 'model = "tiny-llama"\n[prompts]\ntext = ["hi!"]\n'))
    assert case.requests[0].prompt_ids == tuple(b + 3 for b in b"hi!")


def test_defaults_name_and_tolerances(tmp_path):
    path = write(tmp_path, MINIMAL + """
        [tolerance]
        max_abs_logprob_diff = 0.2
        [tolerance.hf]
        k3_kl_max = 0.5
    """, name="mine.toml")
    case = load_case(path)
    assert case.name == "mine" and case.dtypes == ("bfloat16",) and case.backends == ()
    assert case.tolerance == Tolerance(max_abs_logprob_diff=0.2)
    assert case.tolerance_for("hf") == Tolerance(max_abs_logprob_diff=0.2, k3_kl_max=0.5)
    assert case.tolerance_for("vllm") == case.tolerance
    assert default_case().tolerance_for("hf") is None


@pytest.mark.parametrize(("body", "field", "allowed"), [
    (MINIMAL + 'dtypes = ["bf16"]\n', "prompts.dtypes", "token_ids"),  # TOML: a key after [prompts]
    ('dtypes = ["bf16"]\n' + MINIMAL, "dtypes", "bfloat16"),
    ('backends = ["tgi"]\n' + MINIMAL, "backends", "vllm"),
    ('logprobs_mode = "logits"\n' + MINIMAL, "logprobs_mode", "processed"),
    ('router_replay = ["R9"]\n' + MINIMAL, "router_replay", "R3"),
    ('colour = "red"\n' + MINIMAL, "colour", "model"),
    (MINIMAL.replace('model = "tiny-llama"', 'model = "no-such-model"'), "model", "tiny-llama"),
    (MINIMAL.replace("[[3, 4, 5], [6, 7]]", "[[3, -4]]"), "prompts.token_ids[0]", "token ids >= 0"),
    (MINIMAL + 'text = ["x"]\n', "prompts", "exactly one of"),
    ('model = "tiny-llama"\n[prompts.generate]\nkind = "zipf"\n', "prompts.generate.kind", "shared_prefix"),
    ('model = "tiny-llama"\n[prompts.generate]\nkind = "random"\ncount = 2\n'
     'length = { min = 9, max = 3 }\n', "prompts.generate.length", "max (3) < min (9)"),
    ('model = "tiny-llama"\n[prompts.generate]\nkind = "random"\ncount = 2\n'
     'length = { distribution = "zipf", min = 1, max = 3 }\n', "prompts.generate.length.distribution",
     "lognormal"),
    ('model = "tiny-llama"\n[prompts.generate]\nkind = "random"\ncount = 0\nlength = 4\n',
     "prompts.generate.count", ">= 1"),
    (MINIMAL + "[sampling]\ntemperature = -1.0\n", "sampling", "temperature"),
    (MINIMAL + "[sampling]\nbeam = 4\n", "sampling.beam", "top_p"),
    (MINIMAL + "[sampling]\nmax_tokens = 600\n", "prompts", "the model allows 512"),
    (MINIMAL + "[[sampling]]\nlabel = 'a'\n[[sampling]]\nlabel = 'a'\n", "sampling[1].label", "unique"),
    (MINIMAL + "[tolerance]\nmax_abs = 1.0\n", "tolerance", "max_abs_logprob_diff"),
    (MINIMAL + "[tolerance.tgi]\nk3_kl_max = 1.0\n", "tolerance.tgi", "reference"),
    (MINIMAL + "[tolerance]\nk3_kl_max = -1.0\n", "tolerance", ">= 0"),
    ("reference_tensor_parallel_size = 0\n" + MINIMAL, "reference_tensor_parallel_size", ">= 1"),
    ("reference_tensor_parallel_size = true\n" + MINIMAL, "reference_tensor_parallel_size", "must be int"),
])
def test_bad_case_files_name_the_file_the_field_and_the_choices(tmp_path, body, field, allowed):
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_case(path)
    message = str(info.value)
    assert str(path) in message and field in message and allowed in message, message


def test_invalid_toml_and_missing_file_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_case(write(tmp_path, "model = \n"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_case(tmp_path / "absent.toml")


def test_load_cases_accepts_directories_files_and_names(tmp_path, monkeypatch):
    assert [c.name for c in load_cases(f"{CASES}/smoke.toml, {CASES}/moe.toml")] == ["smoke", "moe"]
    assert [c.name for c in load_cases("smoke,grpo-group", cases_dir=CASES)] == ["smoke", "grpo-group"]
    with pytest.raises(ConfigError, match="smoke"):
        load_cases("smok", cases_dir=CASES)
    with pytest.raises(ConfigError, match="more than once"):
        load_cases(f"{CASES}/smoke.toml,smoke", cases_dir=CASES)
    with pytest.raises(ConfigError, match=r"no \*\.toml"):
        load_cases(tmp_path)


def test_case_object_validates_its_fields():
    base = default_case()
    with pytest.raises(ParityError, match="allowed"):
        Case(name="x", model="tiny-llama", requests=base.requests, dtypes=("fp8",))
    with pytest.raises(ParityError, match="at least one prompt"):
        Case(name="x", model="tiny-llama", requests=())


def test_reference_tensor_parallel_size_loads_changes_the_hash_and_needs_a_compare_case(tmp_path):
    one = load_case(write(tmp_path, MINIMAL, name="one.toml"))
    two = load_case(write(tmp_path, "reference_tensor_parallel_size = 2\n" + MINIMAL, name="two.toml"))
    assert one.reference_tensor_parallel_size == 1 and two.reference_tensor_parallel_size == 2
    assert one.hash == load_case(write(tmp_path, "reference_tensor_parallel_size = 1\n" + MINIMAL)).hash
    assert two.hash != one.hash
    lifecycle = load_case(CASES / "lifecycle.toml")
    with pytest.raises(ConfigError, match="reference_tensor_parallel_size applies to compare cases only"):
        dataclasses.replace(lifecycle, reference_tensor_parallel_size=2)
