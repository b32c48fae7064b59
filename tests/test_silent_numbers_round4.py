"""No silent wrong numbers, round 4 (issue 53, items 3, 4, 5, 8, 9, 10, 11, 12): the gold verdicts, `parity
score` of records and dumps, the RL loop, the audit, LoRA adapters and mixed-precision tolerances. Each
input below gave a wrong number, a lost run or a misleading message on the old code; each is now refused
with a `ParityError` naming the field and the fix, or said in words.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from parity.assess.accuracy import gold_summary
from parity.assess.reporting import build_report
from parity.cli import main
from parity.core.errors import AdapterError, ConfigError, DivergedError, InputError
from parity.core.schema import GOLD_RATIO_CI_KEY, GOLD_RATIO_KEY, GOLD_VERDICT_KEY
from parity.core.types import Request, Rollout, SamplingParams
from parity.drift.tolerance import DEFAULTS, Tolerance, pair_dtype
from parity.engine import ReferenceEngine

MODEL = "tiny-llama"
EXACT_ROLLOUT = "the rollout matches the gold exactly; the trainer is farther"
EXACT_TRAINER = "the trainer matches the gold exactly; the rollout is farther"


def _strict(obj: object) -> object:
    """`obj` through strict JSON: a bare NaN/Infinity is refused, as strict parsers refuse it."""
    return json.loads(json.dumps(obj, allow_nan=False))


@pytest.fixture(scope="module")
def rollouts() -> list[Rollout]:
    """Reference rollouts at temperature 1 (processed logprobs = raw ones), float32."""
    requests = [Request((5 + i, 9, 13, 21 + i), SamplingParams(max_tokens=6, temperature=1.0, seed=i),
                        f"r{i}") for i in range(4)]
    return ReferenceEngine(MODEL, dtype="float32").generate(requests)


def _dump(path, rollouts, rollout_logprobs, trainer_logprobs=None, **columns) -> None:
    rows = []
    for ro, lp, tr in zip(rollouts, rollout_logprobs, trainer_logprobs or [None] * len(rollouts)):
        row = {"request_id": ro.request_id, "prompt_ids": list(ro.prompt_ids),
               "response_ids": list(ro.token_ids), "rollout_logprobs": [float(x) for x in lp],
               "temperature": 1.0, **columns}
        if tr is not None:
            row["trainer_logprobs"] = [float(x) for x in tr]
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# item 3: the rollout equals the gold exactly -------------------------------------------------------------


def test_a_rollout_exactly_at_the_gold_is_said_in_words_not_a_zero_division():
    gold = -np.abs(np.random.default_rng(0).standard_normal((12, 8)))
    summary = gold_summary(gold - 0.5, gold.copy(), gold, np.ones_like(gold, bool))
    assert summary[GOLD_RATIO_KEY] == 0.0 and summary[GOLD_RATIO_CI_KEY] == [0.0, 0.0]
    assert summary[GOLD_VERDICT_KEY].startswith(EXACT_ROLLOUT)


@pytest.mark.slow
def test_score_of_a_dump_at_the_gold_writes_every_output(tmp_path, rollouts, capsys, monkeypatch):
    import parity.engine.gold

    # a gold equal to the rollout bit for bit (a float64 gold rarely lands on float32 values by itself)
    monkeypatch.setattr(parity.engine.gold, "gold_logprobs",
                        lambda model, rows, **_: [np.asarray(r.logprobs, np.float64) for r in rows])
    source = tmp_path / "dump.jsonl"
    _dump(source, rollouts, [r.logprobs for r in rollouts], [np.asarray(r.logprobs) - 0.25 for r in rollouts])
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    code = main(["score", str(source), "--trainer-logprobs", "--model", MODEL, "--gold",
                 "--json", str(out_json), "--html", str(out_html)])
    assert code in (0, 1), capsys.readouterr().err
    assert out_json.exists() and out_html.exists()
    summary = json.loads(out_json.read_text())["summary"]
    assert summary[GOLD_VERDICT_KEY].startswith(EXACT_ROLLOUT)


# item 5: gold verdicts on small samples, zero errors, non-finite interval ends ---------------------------


def test_empty_resamples_do_not_pull_a_small_sample_to_equally_far():
    gold = -np.ones((2, 6))
    mask = np.ones_like(gold, bool)
    summary = gold_summary(gold + 0.5, gold + 0.01, gold, mask)  # the trainer off 0.5 on every token
    _, high = summary[GOLD_RATIO_CI_KEY]
    assert high < 1.0 and summary[GOLD_VERDICT_KEY].startswith("the trainer is 50x farther")


def test_a_zero_train_error_is_said_in_words_and_written_as_strict_json():
    gold = -np.ones((6, 4))
    summary = gold_summary(gold.copy(), gold + 0.5, gold, np.ones_like(gold, bool))
    assert "inf" not in summary[GOLD_VERDICT_KEY].replace("infer", "")
    assert summary[GOLD_VERDICT_KEY].startswith(EXACT_TRAINER)
    assert _strict(summary)[GOLD_RATIO_KEY] == "inf" and summary[GOLD_RATIO_CI_KEY] == ["inf", "inf"]
    no_interval = gold_summary(gold + 0.1, gold + 0.2, gold, np.ones_like(gold, bool), bootstrap=0)
    assert _strict(no_interval)[GOLD_RATIO_CI_KEY] == ["nan", "nan"]


def test_the_advisor_reads_an_exact_rollout_without_dividing_by_zero():
    from parity.advisor.rule import gold_note

    gold = -np.ones((6, 4))
    note = gold_note(gold_summary(gold + 0.5, gold.copy(), gold, np.ones_like(gold, bool)))
    assert note is not None and note.startswith("the rollout matches the gold exactly")
    assert gold_note(gold_summary(gold.copy(), gold + 0.5, gold, np.ones_like(gold, bool))) is None


# item 11: every token outside the sampling support ------------------------------------------------------


def test_every_token_outside_the_support_is_said_so(rollouts):
    train = [np.full(len(r.token_ids), -np.inf, np.float32) for r in rollouts]
    with pytest.raises(InputError, match=r"every token \(\d+\) is outside the sampling support \(-inf\)"):
        build_report(rollouts, train, tolerance=Tolerance())


# item 4: a record scored with another model ---------------------------------------------------------------


def _record(path, rollouts, model=MODEL):
    from parity.rollouts.record import write_record

    requests = [Request(r.prompt_ids, r.sampling, r.request_id) for r in rollouts]
    return write_record(path, requests, rollouts, model=model)


def test_a_record_scored_with_another_model_is_refused_naming_both(tmp_path, rollouts, capsys):
    from parity.scoring import score

    path = _record(tmp_path / "run.jsonl", rollouts)
    said = r"model 'tiny-qwen3' \(hash \w+\) is not the model .* sampled with: 'tiny-llama' \(hash \w+\)"
    with pytest.raises(ConfigError, match=said):
        score(path, "tiny-qwen3", gold=True)
    assert main(["score", str(path), "--model", "tiny-qwen3", "--gold"]) == 2
    assert "tiny-llama" in capsys.readouterr().err
    # rollouts that record no hash (another backend's): the header's model is compared by hash
    bare = [dataclasses.replace(r, meta={k: v for k, v in r.meta.items() if k != "model_hash"})
            for r in rollouts]
    with pytest.raises(ConfigError, match="'tiny-llama'"):
        score(_record(tmp_path / "bare.jsonl", bare), "tiny-qwen3")
    score(_record(tmp_path / "same.jsonl", bare), MODEL, gold=False)  # the record's own model scores


def test_the_gold_and_training_forwards_refuse_a_model_the_rollouts_were_not_sampled_with(rollouts):
    from parity.engine import train_forward
    from parity.engine.gold import gold_logprobs

    with pytest.raises(ConfigError, match="is not the model the rollouts were sampled with"):
        gold_logprobs("tiny-qwen3", rollouts)
    with pytest.raises(ConfigError, match="is not the model the rollouts were sampled with"):
        train_forward("tiny-qwen3", rollouts)


# item 12: mixed precision: the rollouts' dtype declared, tolerances from the pair ---------------------------


def test_the_pair_picks_the_less_precise_dtypes_limits():
    assert pair_dtype("float32", "bfloat16") == pair_dtype("bfloat16", "float32") == "bfloat16"
    assert pair_dtype("float32", "float16") == "float16" and pair_dtype("float32") == "float32"
    assert Tolerance.for_backend("vllm", "float32", "bfloat16") == Tolerance(**DEFAULTS["bfloat16"])
    # the reference engine is exact against a training forward of its own dtype only
    assert Tolerance.for_backend("reference", "float32", "float32") == Tolerance.exact()
    assert Tolerance.for_backend("reference", "float32", "bfloat16") == Tolerance(**DEFAULTS["bfloat16"])
    with pytest.raises(ConfigError, match="rollout dtype"):
        pair_dtype("float32", "fp8")


@pytest.fixture(scope="module")
def bf16_rollouts() -> list[Rollout]:
    requests = [Request((5 + i, 9, 13, 21 + i), SamplingParams(max_tokens=8, temperature=1.0, seed=i),
                        f"r{i}") for i in range(4)]
    return ReferenceEngine(MODEL, dtype="bfloat16").generate(requests)


@pytest.mark.slow
def test_bf16_rollouts_scored_by_an_fp32_trainer_are_judged_by_bf16_limits(tmp_path, bf16_rollouts, capsys):
    from parity.scoring import score

    declared = tmp_path / "declared.jsonl"
    _dump(declared, bf16_rollouts, [r.logprobs for r in bf16_rollouts], rollout_dtype="bfloat16")
    report = score(declared, MODEL, dtype="float32", gold=False)
    assert report.tolerance == Tolerance(**DEFAULTS["bfloat16"])
    assert report.provenance["rollout_dtype"] == "bfloat16" and report.provenance["dtype"] == "float32"
    plain = tmp_path / "plain.jsonl"
    _dump(plain, bf16_rollouts, [r.logprobs for r in bf16_rollouts])
    out = tmp_path / "r.json"
    main(["score", str(plain), "--model", MODEL, "--dtype", "float32", "--rollout-dtype", "bfloat16",
          "--no-gold", "--json", str(out)])
    assert json.loads(out.read_text())["tolerance"] == Tolerance(**DEFAULTS["bfloat16"]).to_dict()
    assert main(["score", str(declared), "--model", MODEL, "--rollout-dtype", "float16", "--no-gold"]) == 2
    assert "contradicts the rollouts' record" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    _dump(bad, bf16_rollouts, [r.logprobs for r in bf16_rollouts], rollout_dtype="bf16")
    with pytest.raises(InputError, match="rollout_dtype"):
        score(bad, MODEL, gold=False)


# item 10: LoRA adapters refused at load, naming the file and field ----------------------------------------


def _adapter(tmp_path, name="adapter", weights=None, **config):
    """A copy of the built-in tiny-llama r8 adapter with `config` fields replaced and `weights` changed."""
    from safetensors.numpy import load_file, save_file

    from parity.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, resolve_adapter

    source = resolve_adapter("tiny-llama-lora-r8")
    out = tmp_path / name
    out.mkdir()
    base = json.loads((source / ADAPTER_CONFIG).read_text())
    (out / ADAPTER_CONFIG).write_text(json.dumps({**base, **config}))
    tensors = load_file(str(source / ADAPTER_WEIGHTS))
    for key, change in (weights or {}).items():
        tensors[key] = change(tensors[key])
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    return out


def test_a_malformed_target_regex_names_the_file_and_field(tmp_path):
    from parity.models.lora import check_adapter

    with pytest.raises(AdapterError, match=r"adapter_config.json: target_modules .*not a valid regular"):
        check_adapter(_adapter(tmp_path, target_modules="model.layers.[0-9"), MODEL)


def test_an_adapter_that_selects_no_module_is_refused(tmp_path):
    from parity.models.lora import check_adapter

    with pytest.raises(AdapterError, match=r"target_modules .* selects no module"):
        check_adapter(_adapter(tmp_path, target_modules=r".*\.nothing_here"), MODEL)


def test_nan_weights_and_a_huge_lora_alpha_are_refused_at_load(tmp_path):
    from parity.models.lora import check_adapter

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"

    def poisoned(w):
        w = w.copy()
        w[0, 0] = np.nan
        return w

    with pytest.raises(AdapterError, match=rf"tensor '{key}' holds NaN or inf"):
        check_adapter(_adapter(tmp_path, "nan", weights={key: poisoned}), MODEL)
    with pytest.raises(AdapterError, match=r"lora_alpha=1e\+30"):
        check_adapter(_adapter(tmp_path, "alpha", lora_alpha=1e30), MODEL)
    check_adapter(_adapter(tmp_path, "fine", lora_alpha=16), MODEL)  # a usual alpha loads


def test_an_adapter_made_for_another_built_in_model_is_refused(tmp_path):
    from parity.models.lora import check_adapter

    with pytest.raises(AdapterError, match="base_model_name_or_path 'tiny-qwen2'"):
        check_adapter(_adapter(tmp_path, base_model_name_or_path="tiny-qwen2"), MODEL)
    check_adapter(_adapter(tmp_path, "own", base_model_name_or_path=MODEL), MODEL)
    check_adapter(_adapter(tmp_path, "elsewhere", base_model_name_or_path="/ckpt/llama-base"), MODEL)


# item 8: the RL loop ----------------------------------------------------------------------------------------

#: a short loop: 2 prompts x 2 responses x 4 tokens.
SHORT = {"prompts": 2, "n": 2, "max_tokens": 4}


@pytest.mark.slow
def test_a_reward_that_raises_is_named_with_the_rollout(tmp_path):
    import parity

    def flaky(rollout):
        raise KeyError("answer")

    out = tmp_path / "loop.json"
    with pytest.raises(ConfigError, match=r"reward 'flaky' on rollout 'p0'/0 raised KeyError: 'answer'"):
        parity.loop(MODEL, ["reference"], steps=1, reward=flaky, json=out, **SHORT)
    stored = json.loads(out.read_text())
    assert stored["status"] == "failed" and "reward 'flaky'" in stored["error"]


@pytest.mark.slow
def test_a_huge_learning_rate_is_reported_as_divergence_naming_lr(tmp_path):
    import parity

    with pytest.raises(DivergedError, match=r"lr=1e\+38"):
        parity.loop(MODEL, ["reference"], steps=2, lr=1e38, **SHORT)


@pytest.mark.slow
def test_ctrl_c_records_interrupted(tmp_path):
    import parity

    def stop(rows):
        raise KeyboardInterrupt

    out = tmp_path / "loop.json"
    with pytest.raises(KeyboardInterrupt):
        parity.loop(MODEL, ["reference"], steps=2, json=out, progress=stop, **SHORT)
    stored = json.loads(out.read_text())
    assert stored["status"] == "interrupted" and stored["error"] == "interrupted (Ctrl-C) at step 0"


def test_loop_settings_that_cannot_work_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    import parity
    from parity.loop import run as loop_run

    def no_trainer(*args, **kwargs):
        raise AssertionError("the trainer loaded before the settings were checked")

    monkeypatch.setattr(loop_run, "Trainer", no_trainer)
    with pytest.raises(ConfigError, match=r"lora_rank \(--lora-rank\) 100000 exceeds the smaller dimension"):
        parity.loop(MODEL, ["reference"], steps=1, lora_rank=100000)
    with pytest.raises(ConfigError, match=r"case \(--case\) 'nosuch' is neither"):
        parity.loop(MODEL, ["reference"], steps=1, case="nosuch")
    monkeypatch.chdir(tmp_path)  # outside the repository: no cases/ directory to list
    with pytest.raises(ConfigError, match=r"there is none at"):
        parity.loop(MODEL, ["reference"], steps=1, case="nosuch")
    text = tmp_path / "chat.toml"
    text.write_text('model = "tiny-llama"\n[prompts]\ntext = ["hello there", "how are you"]\n')
    with pytest.raises(ConfigError, match="does not end in an arithmetic problem"):
        parity.loop(MODEL, ["reference"], steps=1, case=text)


# item 9: the audit ---------------------------------------------------------------------------------------


def test_audit_refuses_an_empty_check_list_and_cheap_errors_before_any_load(monkeypatch):
    from parity.audit import run as audit_run

    def no_load(*args, **kwargs):
        raise AssertionError("the workload or model loaded before the settings were checked")

    monkeypatch.setattr(audit_run, "resolve_workload", no_load)
    with pytest.raises(ConfigError, match="checks is empty: nothing would be measured"):
        audit_run.audit(MODEL, "reference", checks=[])
    with pytest.raises(ConfigError, match="backend: unknown 'nosuch'"):
        audit_run.audit(MODEL, "nosuch")
    with pytest.raises(ConfigError, match="batch"):
        audit_run.audit(MODEL, "reference", batch_sizes=[1])
    with pytest.raises(ConfigError, match="device 'cuda:64'"):
        audit_run.audit(MODEL, "reference", device="cuda:64")


def _seed_only_result():
    from parity.audit.result import CHECKS, AuditResult, CheckResult

    checks = {name: CheckResult.skip("not asked for") for name in CHECKS}
    checks["seed"] = CheckResult(identical=False, requests=8, differing_requests=8, first_difference=None,
                                 max_abs_logprob_diff=0.0, mean_abs_logprob_diff=0.0)
    return AuditResult(backend="vllm", model=MODEL, dtype="bfloat16", checks=checks,
                       provenance={"cpu_isa": "AVX2", "gpu": None})


def test_audit_says_not_checked_and_the_control_passing_in_words():
    from parity.render.audit import audit_html

    result = _seed_only_result()
    text = result.summary_text()
    first = text.splitlines()[0]
    assert "deterministic not checked, batch-invariant not checked" in first
    assert "a property of this engine and workload on this machine (CPU AVX2, no GPU)" in first
    assert "seeds change the samples: as expected (8 of 8 requests differ)" in text
    assert "NO" not in text
    page = audit_html(result.to_dict())
    assert "deterministic: not checked" in page and "seeds change the samples: as expected" in page
    assert 'class="differs"' not in page and "verdict no" not in page


@pytest.mark.parametrize(("flags", "isa"), [("fpu avx2 avx512f amx_tile", "AMX"), ("avx2 avx512f", "AVX-512"),
                                            ("sse4_2 avx2", "AVX2")])
def test_provenance_records_the_cpu_isa_and_gpu(tmp_path, flags, isa):
    from parity.report.provenance import cpu_isa, provenance

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert cpu_isa(info) == isa
    prov = provenance(MODEL, backend="reference", backend_meta={}, dtype="float32", device="cpu",
                      reference="invariant", router_replay=None, seeds=[], case="c", case_hash="h",
                      rollout_logprobs="here")
    assert "cpu_isa" in prov and prov["gpu"] is None


def test_a_server_that_never_answers_metadata_fails_at_the_metadata_timeout():
    import socket

    from parity.backends.http import Endpoint, HttpClient, HttpSettings
    from parity.core.errors import BackendError

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)  # accepts connections (the kernel's backlog), never answers
        port = server.getsockname()[1]
        client = HttpClient(Endpoint.parse(f"http://127.0.0.1:{port}"),
                            HttpSettings(request_timeout_s=600.0, metadata_timeout_s=0.5, retries=0))
        with pytest.raises(BackendError, match=r"no answer within the metadata timeout of 0.5 s"):
            client.get("/v1/models")


@pytest.mark.slow
def test_an_adapter_only_loop_that_blows_up_is_divergence_not_a_broken_adapter():
    import parity

    def by_sample(rollout):  # rewards that differ within each group: the update moves the adapter
        return float(rollout.sample_index)

    with pytest.raises(DivergedError, match="diverged at step"):
        parity.loop(MODEL, ["reference"], steps=3, lora_rank=4, lr=1e30, reward=by_sample, **SHORT)


# item 15: the cache variable and a Monitor store handed to advise -----------------------------------------

@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_cache_that_cannot_be_made_names_parity_cache(tmp_path, monkeypatch, capsys, where):
    from parity.models import resolve_model

    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PARITY_CACHE", str(blocker if where == "a file" else blocker / "deeper"))
    with pytest.raises(ConfigError, match=r"PARITY_CACHE: cannot create the checkpoint cache directory .*"
                                          r"set PARITY_CACHE to a writable directory"):
        resolve_model("tiny-llama")
    assert main(["compare", "--model", "tiny-llama", "--backend", "reference"]) == 2
    err = capsys.readouterr().err
    assert "PARITY_CACHE" in err and "NotADirectoryError" not in err and len(err.strip().splitlines()) == 1


def test_advise_names_a_monitor_store_and_binary_files(tmp_path, capsys):
    import sqlite3

    store = tmp_path / "monitor.sqlite"
    sqlite3.connect(store).execute("create table t (x)").connection.commit()
    assert main(["advise", str(store)]) == 2
    err = capsys.readouterr().err
    assert "is an SQLite file" in err and "parity monitor OUT_DIR" in err and "Unicode" not in err
    binary = tmp_path / "blob.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert main(["advise", str(binary)]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text" in err and "Unicode" not in err


@pytest.mark.slow
def test_compare_takes_a_trainer_dtype_apart_from_the_engines():
    """Item 12 for compare: a float32 trainer beside a bf16 engine is scored in float32 and judged by the
    pair's (bf16) limits; the same engine against a bf16 trainer is the control (bit for bit, dtype kept)."""
    import parity

    mixed = parity.compare(MODEL, "reference", dtype="bfloat16", trainer_dtype="float32")
    assert mixed.provenance["dtype"] == "float32" and mixed.provenance["rollout_dtype"] == "bfloat16"
    # the reference engine's exactness is a claim within one dtype: a mixed pair gets bf16's limits
    assert mixed.tolerance == Tolerance(**DEFAULTS["bfloat16"]) != Tolerance.exact()
    assert mixed.summary["max_abs_logprob_diff"] > 0 and mixed.passed  # a bf16 engine, within bf16's limits
    same = parity.compare(MODEL, "reference", dtype="bfloat16")
    assert same.summary["max_abs_logprob_diff"] == 0 and "rollout_dtype" not in same.provenance
    with pytest.raises(ConfigError, match="trainer_dtype"):
        parity.compare(MODEL, "reference", trainer_dtype="float64")
