"""LoRA through every entry point: compare(lora=), --lora on compare/score/replay/nightly, `lora` in
case files; bad adapters refused before any engine starts; peft's PeftModel as the hf backend; the
adapter-sync check catching a stale adapter and a wrong lora_alpha on the CPU backends."""

import dataclasses
import json
import sys
import textwrap

import pytest
import torch
from test_lora import step_adapter

import parity
from parity import Request, SamplingParams
from parity.backends import get_backend, lora_backends, lora_options, shared_backend
from parity.backends.registry import BACKENDS, backend_options
from parity.backends.weight_sync import (
    DOUBLE_SCALING,
    EXPECTED,
    PREVIOUS,
    check_adapter_sync,
)
from parity.cli import main
from parity.core.errors import AdapterError, ConfigError
from parity.engine import train_forward
from parity.models.lora import check_adapter
from parity.nightly import main as nightly_main
from parity.rollouts.command import main as replay_main
from parity.rollouts.record import read_record
from parity.workload.cases import load_case

pytestmark = pytest.mark.usefixtures("one_thread")

ADAPTER = "tiny-llama-lora-r8"
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], [100, 101, 102]]
SAMPLING = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=3)
#: sequences the adapter-sync check scores: 3 prompts with 12 fixed response tokens each.
SEQUENCES = [(tuple(p), tuple(range(60 + i, 72 + i))) for i, p in enumerate(PROMPTS)]


def test_lora_capability_matches_the_adapters_options():
    """`BackendSpec.lora` says which backends take a `lora` option, and only those do."""
    for name, spec in BACKENDS.items():
        assert spec.lora == ("lora" in backend_options(name)), name
    assert lora_backends() == ["reference", "hf", "vllm", "vllm-server"]
    with pytest.raises(AdapterError, match=r"backend 'sglang' cannot apply a LoRA adapter.*reference, hf"):
        lora_options("sglang", ADAPTER)


def test_compare_reference_with_an_adapter_is_exact():
    report = parity.compare("tiny-llama", "reference", lora=ADAPTER, prompts=PROMPTS, sampling=SAMPLING,
                            dtype="float32")
    assert report.passed and report.summary["max_abs_logprob_diff"] == 0.0
    lora = report.provenance["lora"]
    assert lora["hash"] == check_adapter(ADAPTER, "tiny-llama").hash and lora["r"] == 8
    assert report.provenance["backend_meta"]["lora"]["hash"] == lora["hash"]


def test_bad_adapters_are_refused_before_any_engine_starts(monkeypatch, tmp_path):
    def no_engine(*args, **kwargs):
        raise AssertionError("an engine started")

    monkeypatch.setattr(sys.modules["parity.compare"], "shared_backend", no_engine)
    with pytest.raises(AdapterError, match=r"not a directory nor a built-in adapter"):
        parity.compare("tiny-llama", "vllm", lora=tmp_path / "missing")
    with pytest.raises(AdapterError, match=r"attention projections of a MoE model"):
        parity.compare("tiny-qwen3-moe", "vllm", lora=ADAPTER)
    with pytest.raises(AdapterError, match=r"backend 'sglang' cannot apply a LoRA adapter"):
        parity.compare("tiny-llama", "sglang", lora=ADAPTER)
    with pytest.raises(AdapterError, match=r"without tensor parallelism"):
        parity.compare("tiny-llama", "reference", lora=ADAPTER, tensor_parallel=2)
    with pytest.raises(ConfigError, match=r"attribute does not run with a LoRA adapter"):
        parity.compare("tiny-llama", "reference", lora=ADAPTER, attribute=["batch"])


def test_a_running_backend_with_another_adapter_is_refused():
    engine = shared_backend("reference", "tiny-llama", dtype="float32")
    with pytest.raises(ConfigError, match=r"applies LoRA adapter none, not adapter"):
        parity.compare("tiny-llama", engine, lora=ADAPTER, prompts=PROMPTS, dtype="float32")


def test_cli_compare_score_and_replay_with_lora(tmp_path, capsys):
    record = tmp_path / "run.jsonl"
    assert main(["compare", "--model", "tiny-llama", "--backend", "reference", "--dtype", "float32",
                 "--lora", ADAPTER, "--record", str(record), "--json", str(tmp_path / "r.json")]) == 0
    stored = json.loads((tmp_path / "r.json").read_text())
    assert stored["provenance"]["lora"]["r"] == 8 and stored["summary"]["max_abs_logprob_diff"] == 0.0
    assert read_record(record).meta["lora"]["hash"] == check_adapter(ADAPTER, "tiny-llama").hash
    # the record says which adapter: score follows it, and refuses another
    assert main(["score", str(record), "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["summary"]["max_abs_logprob_diff"] == 0.0
    capsys.readouterr()
    assert main(["score", str(record), "--lora", "tiny-llama-lora-r64"]) == 2
    assert "contradicts the rollouts' record" in capsys.readouterr().err
    # replay through hf applies the record's adapter by default
    out = tmp_path / "run.hf.jsonl"
    assert replay_main([str(record), "--backend", "hf", "--dtype", "float32", "--out", str(out)]) == 0
    replayed = read_record(out).rollouts["hf"]
    assert {r.meta["lora"]["hash"] for r in replayed} == {check_adapter(ADAPTER, "tiny-llama").hash}
    assert main(["compare", "--model", "tiny-llama", "--backend", "reference", "--lora", str(tmp_path)]) == 2
    assert "has no adapter_config.json" in capsys.readouterr().err


@pytest.mark.slow
def test_case_files_name_an_adapter(tmp_path):
    adapter = step_adapter(tmp_path, ADAPTER, seed=5, directory="my-adapter")
    case = tmp_path / "lora.toml"
    case.write_text(textwrap.dedent(f"""
        model = "tiny-llama"
        lora = "{adapter.name}"
        dtypes = ["float32"]
        backends = ["reference"]
        [prompts]
        token_ids = {PROMPTS}
        [sampling]
        n = 2
        max_tokens = 8
    """))
    loaded = load_case(case)
    assert loaded.lora == str(adapter)
    assert loaded.hash != dataclasses.replace(loaded, lora=None).hash
    bad = tmp_path / "bad.toml"
    bad.write_text(case.read_text().replace(adapter.name, "nowhere"))
    with pytest.raises(ConfigError, match=r"bad.toml: lora: .*nowhere.*not a directory"):
        load_case(bad)
    moe = tmp_path / "moe.toml"
    moe.write_text(case.read_text().replace('model = "tiny-llama"', 'model = "tiny-qwen3-moe"'))
    with pytest.raises(ConfigError, match=r"moe.toml: lora: .*MoE model"):
        load_case(moe)
    # nightly: the case's adapter on its reference row, bitwise; --lora against it is refused
    out = tmp_path / "reports"
    assert nightly_main(["--cases", str(case), "--backends", "reference", "--out", str(out),
                         "--no-progress"]) == 0
    results = json.loads(next(out.glob("*/results.json")).read_text())
    row = results["rows"][0]
    assert row["status"] == "pass" and row["summary"]["max_abs_logprob_diff"] == 0.0
    assert row["provenance"]["lora"]["hash"] == check_adapter(adapter, "tiny-llama").hash
    assert nightly_main(["--cases", str(case), "--backends", "reference", "--out", str(out), "--no-progress",
                         "--lora", ADAPTER]) == 2


@pytest.mark.slow
def test_nightly_lora_applies_to_every_case(tmp_path):
    case = tmp_path / "plain.toml"
    case.write_text(textwrap.dedent(f"""
        model = "tiny-llama"
        dtypes = ["float32"]
        [prompts]
        token_ids = {PROMPTS[:1]}
        [sampling]
        max_tokens = 6
    """))
    out = tmp_path / "reports"
    # sglang cannot apply an adapter: its cell is left out of the matrix (as R3's are on backends
    # that cannot record routes), not run as an error row no setting could fix
    assert nightly_main(["--cases", str(case), "--backends", "reference,sglang", "--out", str(out),
                         "--no-progress", "--lora", ADAPTER]) == 0
    rows = json.loads(next(out.glob("*/results.json")).read_text())["rows"]
    assert [r["backend"] for r in rows] == ["reference"]
    assert rows[0]["status"] == "pass" and rows[0]["provenance"]["lora"]["r"] == 8


# -- peft's PeftModel as the hf backend ------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_backend_runs_the_adapter_through_peft(tmp_path, dtype):
    with get_backend("hf", "tiny-llama", dtype=dtype, lora=ADAPTER) as hf:
        assert type(hf._model).__name__ == "PeftModelForCausalLM"
        report = parity.compare("tiny-llama", hf, lora=ADAPTER, prompts=PROMPTS, sampling=SAMPLING,
                                dtype=dtype)
        # fp32: padded SDPA vs the invariant forward only; bf16: HF's bf16 rounding
        assert report.summary["max_abs_logprob_diff"] < (1e-4 if dtype == "float32" else 0.2)
        step = step_adapter(tmp_path, ADAPTER, seed=11)
        hf.load_adapter(step)
        assert hf.meta["lora"]["hash"] == check_adapter(step, "tiny-llama").hash
        rollouts = hf.generate([Request(tuple(p), SAMPLING, f"p{i}") for i, p in enumerate(PROMPTS)])
        scored = train_forward("tiny-llama", rollouts, dtype=dtype).logprobs  # follows the recorded adapter
        drift = max(float((torch.tensor(r.logprobs) - s).abs().max()) for r, s in zip(rollouts, scored))
        assert drift < (1e-4 if dtype == "float32" else 0.2)


def test_a_shared_backend_refuses_a_swap():
    engine = shared_backend("reference", "tiny-llama", dtype="float32", lora=ADAPTER)
    with pytest.raises(ConfigError, match=r"shared .* swap adapters on a backend of your own"):
        engine.load_adapter("tiny-llama-lora-r8")


# -- the adapter-sync check: catches a stale adapter and a wrong lora_alpha -------------------------


@pytest.mark.parametrize("backend", ["reference", "hf"])
def test_adapter_sync_after_a_correct_swap(tmp_path, backend):
    step = step_adapter(tmp_path, ADAPTER, seed=21)
    with get_backend(backend, "tiny-llama", dtype="float32", lora=ADAPTER) as engine:
        engine.load_adapter(step)
        result = check_adapter_sync(engine, SEQUENCES, expected=step, previous=ADAPTER)
    assert result.passed, result
    assert result.distances[EXPECTED] < 1e-4 and min(result.distances.values()) == result.distances[EXPECTED]


@pytest.mark.parametrize("backend", ["reference", "hf"])
def test_adapter_sync_catches_a_stale_adapter(tmp_path, backend):
    """The bug: the trainer moved to the next step's adapter and the engine still applies the old one
    (here the swap never happened, as when an engine caches adapters by id and gets an old id)."""
    step = step_adapter(tmp_path, ADAPTER, seed=21)
    with get_backend(backend, "tiny-llama", dtype="float32", lora=ADAPTER) as engine:
        result = check_adapter_sync(engine, SEQUENCES, expected=step, previous=ADAPTER)
    assert not result.passed and result.verdict == PREVIOUS, result


@pytest.mark.parametrize("backend", ["reference", "hf"])
def test_adapter_sync_catches_a_wrong_lora_alpha(tmp_path, backend):
    """The bug: the engine got the right weights with lora_alpha doubled (a stale or hand-edited
    adapter_config.json): the check names the doubled scaling."""
    doubled = step_adapter(tmp_path, ADAPTER, seed=21, alpha=32, directory="doubled")
    right = step_adapter(tmp_path, ADAPTER, seed=21, directory="right")
    with get_backend(backend, "tiny-llama", dtype="float32", lora=ADAPTER) as engine:
        engine.load_adapter(doubled)
        result = check_adapter_sync(engine, SEQUENCES, expected=right, previous=ADAPTER)
    assert not result.passed and result.verdict == DOUBLE_SCALING, result
