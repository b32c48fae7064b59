"""The RL loop on the reference engine: bitwise at every step while the policy moves, reproducible,
a skipped weight push caught, bad input refused before step 0, divergence named by its step."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import parity
from parity.backends import get_backend
from parity.backends.reference import ReferenceBackend
from parity.cli import main
from parity.core.errors import ConfigError, DivergedError
from parity.correction import CorrectionConfig, correction_from_name
from parity.loop import run as loop_run
from parity.loop.config import LoopConfig
from parity.loop.grpo import group_advantages, plan_loss
from parity.loop.record import STEP_EXTRA_KEYS, STEP_KEYS, UPDATE_KEYS, LoopRecord, without_timing
from parity.loop.task import FORMAT_CREDIT, answer_of, arithmetic_reward, problems
from parity.nightly.execute import execute_row
from parity.nightly.rows import RowKey
from parity.workload.cases import load_case

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
#: a short run's settings: 4 prompts x 4 responses x 8 tokens (a learning rate that moves the policy).
SMALL = {"prompts": 4, "n": 4, "max_tokens": 8, "lr": 3e-3}


def _check_claims(record: LoopRecord, steps: int) -> None:
    rows = record.rows("reference")
    assert [row["step"] for row in rows] == list(range(steps))
    for row in rows:
        assert row["bitwise"] and row["max_abs_logprob_diff"] == 0.0 and row["k3_kl"] == 0.0
        assert row["is_ratio_mean"] == 1.0 and row["clip_fraction"] == 0.0
        assert row["weights_in_sync"]
    assert all(update["forward_bitwise"] for update in record.updates)
    kl = [row["policy_kl_from_start"] for row in rows]
    assert kl[0] == 0.0 and all(k > 0 for k in kl[1:])  # the policy moves every step


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe"])
def test_reference_rollouts_equal_the_training_forward_at_every_step(model, tmp_path):
    """Requirement 3: 20 steps, every rollout logprob == the training forward's bit for bit at that
    step's weights (the loop compares with torch.equal), while the policy moves away from W_0."""
    record = parity.loop(model, ["reference"], steps=20, seed=1, json=tmp_path / "loop.json", **SMALL)
    _check_claims(record, 20)
    assert record.status == "complete"
    stored = json.loads((tmp_path / "loop.json").read_text())
    assert stored == json.loads(record.to_json())
    assert all(list(row)[:len(STEP_KEYS)] == list(STEP_KEYS) for row in stored["steps"])  # in order
    assert all(set(row) == {*STEP_KEYS, *STEP_EXTRA_KEYS} for row in stored["steps"])
    assert all(set(update) == set(UPDATE_KEYS) for update in stored["updates"])


def test_half_precision_trains_float32_masters():
    """bfloat16 model, float32 master weights: a learning rate far below the bfloat16 ulp of the
    weights still moves the policy (masters accumulate), and the claims hold."""
    record = parity.loop("tiny-llama", ["reference"], steps=4, dtype="bfloat16", **{**SMALL, "lr": 1e-4})
    _check_claims(record, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe"])
def test_reference_loop_is_bitwise_on_cuda(model, dtype):
    """The claim on a GPU: the Triton kernels' forward under autograd, the engine's CUDA graphs, a
    bfloat16 model with float32 master weights."""
    record = parity.loop(model, ["reference"], steps=20, seed=1, dtype=dtype, device="cuda", **SMALL)
    _check_claims(record, 20)


def test_native_reference_engine_is_not_bitwise():
    """Negative control: the same loop with the engine on stock kernels differs from the training
    forward, and the record says so."""
    record = parity.loop("tiny-llama", ["reference"], steps=2,
                         backend_options={"reference": {"kernels": "native"}},
                         **SMALL)
    assert not all(row["bitwise"] for row in record.steps)
    assert max(row["max_abs_logprob_diff"] for row in record.steps) > 0


def test_a_borrowed_engine_is_recorded_in_its_own_dtype():
    """A reference engine started in bfloat16 beside the float32 trainer: the record says bfloat16
    and the steps are not bitwise (never a float32 claim); a backend_dtypes entry that contradicts
    the engine is refused before any step."""
    engine = get_backend("reference", "tiny-llama", dtype="bfloat16")
    try:
        with pytest.raises(ConfigError, match=r"backend_dtypes\['reference'\] is 'float32', but the running"):
            parity.loop("tiny-llama", [engine], steps=1, backend_dtypes={"reference": "float32"}, **SMALL)
        record = parity.loop("tiny-llama", [engine], steps=1, **SMALL)
    finally:
        engine.close()
    assert record.config["backend_dtypes"] == {"reference": "bfloat16"}
    assert not any(row["bitwise"] for row in record.steps)


def test_same_seed_same_json_except_seconds(tmp_path):
    """Two runs with one seed write identical JSON once every "seconds" field is dropped; another
    seed does not (so the comparison can fail)."""
    docs = []
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        parity.loop("tiny-llama", ["reference"], steps=3, seed=seed, json=tmp_path / f"{name}.json", **SMALL)
        docs.append(json.loads((tmp_path / f"{name}.json").read_text()))
    assert without_timing(docs[0]) == without_timing(docs[1])
    assert docs[0] != docs[1]  # the seconds differ: they are what is excluded
    assert without_timing(docs[0])["steps"] != without_timing(docs[2])["steps"]


def test_skipped_push_is_caught(monkeypatch):
    """Negative control of the weight sync: a push that silently does nothing (the second one, made
    after step 1) leaves the engine on old weights, and step 2's row reports it out of sync."""
    calls = []
    push = ReferenceBackend.update_weights

    def flaky(self, named_tensors):
        calls.append(1)
        if len(calls) != 3:  # the 1st is the starting sync, the 2nd after step 0, the 3rd after step 1
            push(self, named_tensors)

    monkeypatch.setattr(ReferenceBackend, "update_weights", flaky)
    # a reward with variance in every group: every update moves the weights
    record = parity.loop("tiny-llama", ["reference"], steps=4, reward=lambda r: float(sum(r.token_ids) % 7),
                         **SMALL)
    in_sync = [row["weights_in_sync"] for row in record.steps]
    assert in_sync == [True, True, False, True]
    assert "tensors differ" in record.steps[2]["sync_detail"]
    assert not record.steps[2]["bitwise"]  # the stale engine's rollouts are off the trained policy


def test_backend_without_weight_sync_is_refused_before_step_0(monkeypatch):
    def no_trainer(*args, **kwargs):
        raise AssertionError("the trainer started")

    monkeypatch.setattr(loop_run, "Trainer", no_trainer)
    with pytest.raises(ConfigError, match="'hf' has no weight-update API"):
        parity.loop("tiny-llama", ["reference", "hf"], steps=2)
    with pytest.raises(ConfigError, match="'trtllm' has no weight-update API"):
        parity.loop("tiny-llama", ["reference", "trtllm"], steps=2)


def test_diverged_loss_stops_with_the_step_named(tmp_path):
    """A learning rate that blows the weights up: the loop stops with DivergedError naming the step
    and the JSON keeps every step before it."""
    out = tmp_path / "loop.json"
    with pytest.raises(DivergedError, match=r"diverged at step \d+"):
        parity.loop("tiny-llama", ["reference"], steps=6, json=out, **{**SMALL, "lr": 1e30, "max_tokens": 4})
    stored = json.loads(out.read_text())
    assert stored["status"] == "diverged" and stored["error"].startswith("step ")
    failed = int(stored["error"].split()[1].rstrip(":"))
    assert failed >= 1 and [row["step"] for row in stored["steps"]] == list(range(failed))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"steps": 0}, "steps"), ({"lr": -1.0}, "lr"), ({"lr": math.nan}, "lr"), ({"n": 0}, "n"),
    ({"backends": ["reference", "nope"]}, "unknown backend"), ({"train_on": "vllm"}, "train_on"),
    ({"correction": "token_tis:zero"}, "rollout_is_threshold"),
    ({"correction": "magic"}, "unknown correction"),
    ({"backend_dtypes": {"vllm": "bfloat16"}}, "not among the backends"), ({"dtype": "int8"}, "dtype"),
])
def test_bad_settings_are_refused(kwargs, match):
    settings = {"model": "tiny-llama", **kwargs}
    with pytest.raises(ConfigError, match=match):
        LoopConfig(**settings)


def test_correction_names():
    assert correction_from_name("none") == CorrectionConfig(rollout_is=None)
    assert correction_from_name("token_tis") == CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    assert correction_from_name("sequence_tis:5") == CorrectionConfig(rollout_is="sequence",
                                                                      rollout_is_threshold=5.0)
    assert correction_from_name("icepop:0.8_1.25").is_rule.band_lower == 0.8
    assert correction_from_name("seq_mean_k3:0.01").rs_rules[0].option == "seq_mean_k3"
    for bad in ("icepop:2", "seq_mean_k3", "tis"):
        with pytest.raises(ConfigError):
            correction_from_name(bad)


def test_group_advantages_are_verl_grpo():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as verl's torch.std
    assert torch.allclose(adv[0], (rewards[0] - 0.5).double() / (std.double() + 1e-6))
    assert torch.equal(adv[1], torch.zeros(4, dtype=torch.float64))  # equal rewards teach nothing


def test_reference_correction_weights_are_exactly_one():
    """On the reference engine the correction sees identical logprobs: weights 1, nothing rejected."""
    lp = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    plan = plan_loss(lp, [t.clone() for t in lp], [1.0, -1.0], correction_from_name("token_tis"))
    assert torch.equal(plan.weights[plan.keep], torch.ones(3)) and plan.kept_tokens == 3


def test_arithmetic_task_checks_answers_exactly():
    assert arithmetic_reward("42", 42) == 1.0
    assert arithmetic_reward(" 42\n7", 42) == 1.0
    assert arithmetic_reward("-3 apples", -3) == 1.0
    assert arithmetic_reward("421", 42) == FORMAT_CREDIT  # another number, digits covering the answer
    assert arithmetic_reward("4", 42) == FORMAT_CREDIT / 2
    assert arithmetic_reward("forty-two", 42) == 0.0
    chosen = problems(16, seed=0, max_operand=20)
    assert chosen == problems(16, seed=0, max_operand=20) != problems(16, seed=1, max_operand=20)
    for text, answer in chosen:
        assert eval(text.rstrip("=")) == answer


def test_command_line(tmp_path, capsys):
    out, page = tmp_path / "loop.json", tmp_path / "loop.html"
    code = main(["loop", "--model", "tiny-llama", "--steps", "2", "--prompts", "2", "--n", "2",
                 "--max-tokens", "4", "--correction", "token_tis", "--json", str(out), "--html", str(page)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "max|dlogp|" in printed and printed.count("reference") >= 2
    assert LoopRecord.read(out).status == "complete"
    assert "policy KL from start" in page.read_text()
    assert main(["loop", "--model", "tiny-llama", "--backends", "reference,hf", "--steps", "1"]) == 2


@pytest.mark.slow
def test_a_sigterm_mid_loop_keeps_the_steps_and_says_interrupted(tmp_path):
    """`timeout` or a scheduler stops `parity loop` with SIGTERM: one line, exit 143, and the record
    says "interrupted (SIGTERM)" with every finished step kept (Python's default SIGTERM ends the
    process without running a `finally`: the record stayed "running")."""
    out = tmp_path / "loop.json"
    entry = "import sys; from parity.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", entry, "loop", "--model", "tiny-llama",
                             "--steps", "100000", "--prompts", "2", "--n", "2", "--max-tokens", "4",
                             "--json", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline and not (
                out.exists() and LoopRecord.read(out).steps):
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == "parity: terminated (SIGTERM)" and "Traceback" not in err
    record = LoopRecord.read(out)
    assert record.status == "interrupted" and record.error.startswith("interrupted (SIGTERM) at step")
    assert record.steps


def test_answers_are_read_off_the_prompt():
    assert answer_of("12+7=") == 19 and answer_of("Q: 6 * 7 =") == 42 and answer_of("3--2=") == 5
    assert answer_of("hello") is None and answer_of("1+2=3") is None


def test_a_case_of_arithmetic_prompts_needs_no_reward(tmp_path):
    case = load_case(ROOT / "cases" / "loop.toml")
    record = parity.loop("tiny-llama", ["reference"], steps=2, case=case, **SMALL)
    assert record.config["task"] == "case loop" and record.status == "complete"
    other = load_case(ROOT / "cases" / "smoke.toml")  # random token prompts: nothing to check
    with pytest.raises(ConfigError, match="does not end in an arithmetic problem"):
        parity.loop("tiny-llama", ["reference"], steps=1, case=other)
    record = parity.loop("tiny-llama", ["reference"], steps=1, case=other,
                         reward=lambda rollout: len(rollout.token_ids) % 2)
    assert record.status == "complete"


def test_loop_case_settings_are_checked(tmp_path):
    text = (ROOT / "cases" / "loop.toml").read_text()
    for field, line in (("lr", "lr = -1.0"), ("steps", "steps = 0")):
        path = tmp_path / f"{field}.toml"
        rows = text.splitlines()
        path.write_text("\n".join(line if row.startswith(f"{field} = ") else row for row in rows))
        with pytest.raises(ConfigError, match=f"loop.{field}"):
            load_case(path)
    path = tmp_path / "kind.toml"
    path.write_text(text.replace('kind = "loop"', 'kind = "compare"'))
    with pytest.raises(ConfigError, match="only a loop case has loop settings"):
        load_case(path)


def test_nightly_loop_row():
    case = load_case(ROOT / "cases" / "loop.toml")
    row = execute_row("r1", RowKey(case.name, "reference", "float32"), case, reference="invariant")
    assert row.status == "pass", row.error or row.violations
    assert row.summary["max_abs_logprob_diff"] == 0.0 and row.summary["loop_steps_bitwise"] == case.loop_steps
    assert row.summary["loop_policy_kl_final"] > 0 and row.provenance["kind"] == "loop"
    assert len(row.provenance["loop"]["steps"]) == case.loop_steps
