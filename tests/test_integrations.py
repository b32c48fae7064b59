"""verl, NeMo-RL and slime batches read as they are: the monitor logs them and `dump_batch` writes
the parity dump `parity score` reads, its sampling taken from verl's `meta_info`.

The batches are stand-ins of the same shape built from real rollouts of parity's reference engine
(float32): scoring the dump with the training forward then gives zero drift, bit for bit, which
holds only when prompts, responses, padding and the temperature all came through right (the
negative control changes the temperature in meta_info and sees drift)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

import parity
from parity.backends import shared_backend
from parity.cli import main
from parity.core.errors import ConfigError, InputError
from parity.core.types import Request, SamplingParams
from parity.integrations import nemo_rl, slime, verl
from parity.report.document import ParityReport
from parity.rollouts.dumps import read_dump

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")
TEMPERATURE = 0.7
#: a value at padding that is no logprob: every reader must ignore it
JUNK = 7.0


class TensorDictLike(dict):
    """Like tensordict's TensorDict (verl's `batch.batch`): `key in td` raises; `.keys()` works."""

    def __contains__(self, key):
        raise NotImplementedError("TensorDict does not support membership checks with the `in` keyword")


@dataclass
class DataProtoLike:
    """verl's DataProto as the readers see it."""

    batch: TensorDictLike
    meta_info: dict = field(default_factory=dict)
    non_tensor_batch: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def rollouts():
    """Reference-engine rollouts (float32) of prompts of different lengths, 2 samples each, at T=0.7."""
    engine = shared_backend("reference", "tiny-llama", dtype="float32")
    requests = [Request(prompt_ids=tuple(range(5, 5 + n)), request_id=f"q{i}",
                        sampling=SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=6 + 3 * i,
                                                seed=11 + i))
                for i, n in enumerate((3, 9, 5))]
    out = sorted(engine.generate(requests), key=lambda r: r.key)
    assert len({len(r.token_ids) for r in out}) > 1  # ragged responses, so padding matters
    return out


def trainer_logprobs(r) -> np.ndarray:
    """The trainer's logprobs of a rollout's tokens in these tests: the rollout's, drifted."""
    rng = np.random.default_rng(len(r.token_ids) + r.sample_index)
    return np.minimum(np.asarray(r.logprobs) + rng.normal(0.0, 0.05, len(r.logprobs)), 0.0).astype(np.float32)


def verl_batch(rollouts, *, temperature=TEMPERATURE, tool_tokens: int = 0) -> DataProtoLike:
    """The batch verl's fit holds after old_log_prob: prompts left-padded, responses right-padded;
    `tool_tokens` > 0 marks response tokens 1..tool_tokens of every row as injected (mask 0)."""
    batch, width = len(rollouts), max(len(r.token_ids) for r in rollouts)
    plen = max(len(r.prompt_ids) for r in rollouts)
    prompts = torch.zeros(batch, plen, dtype=torch.int64)
    responses = torch.zeros(batch, width, dtype=torch.int64)
    attention = torch.zeros(batch, plen + width, dtype=torch.int64)
    rollout = torch.full((batch, width), JUNK, dtype=torch.float32)
    old = torch.full((batch, width), JUNK, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.token_ids)
        prompts[i, plen - p:] = torch.tensor(r.prompt_ids)
        responses[i, :n] = torch.tensor(r.token_ids)
        attention[i, plen - p:plen + n] = 1
        rollout[i, :n] = torch.tensor(r.logprobs)
        old[i, :n] = torch.from_numpy(trainer_logprobs(r))
    response_mask = attention[:, plen:].clone()
    if tool_tokens:
        response_mask[:, 1:1 + tool_tokens] = 0
    tensors = TensorDictLike(prompts=prompts, responses=responses, attention_mask=attention,
                             response_mask=response_mask, rollout_log_probs=rollout, old_log_probs=old)
    return DataProtoLike(tensors, {"temperature": temperature},
                         {"uid": np.array([r.request_id for r in rollouts], dtype=object)})


def nemo_rl_data(rollouts) -> dict:
    """NeMo-RL's train_data: whole sequences, logprob of token i at position i, right-padded."""
    seqs = [list(r.prompt_ids) + list(r.token_ids) for r in rollouts]
    width = max(map(len, seqs)) + 2
    data = {k: torch.zeros(len(seqs), width, dtype=d) for k, d in
            (("input_ids", torch.int64), ("token_mask", torch.int64), ("generation_logprobs", torch.float32),
             ("prev_logprobs", torch.float32))}
    for i, (r, s) in enumerate(zip(rollouts, seqs)):
        p = len(r.prompt_ids)
        data["input_ids"][i, :len(s)] = torch.tensor(s)
        data["token_mask"][i, p:len(s)] = 1
        data["generation_logprobs"][i, p:len(s)] = torch.tensor(r.logprobs)
        data["prev_logprobs"][i, p:len(s)] = torch.from_numpy(trainer_logprobs(r))
        data["generation_logprobs"][i, len(s):] = JUNK
    data["input_lengths"] = torch.tensor([len(s) for s in seqs])
    data["sample_mask"] = torch.ones(len(seqs))
    return data


def slime_data(rollouts) -> dict:
    """slime's rollout_data: one tensor per sample."""
    return {"tokens": [list(r.prompt_ids) + list(r.token_ids) for r in rollouts],
            "rollout_log_probs": [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts],
            "log_probs": [torch.from_numpy(trainer_logprobs(r)) for r in rollouts],
            "loss_masks": [torch.ones(len(r.token_ids), dtype=torch.int32) for r in rollouts],
            "response_lengths": [len(r.token_ids) for r in rollouts]}


def score(dump: Path, tmp_path: Path, *extra: str) -> ParityReport:
    out = tmp_path / f"{dump.stem}.json"
    assert main(["score", str(dump), "--json", str(out), *extra]) in (0, 1)
    return ParityReport.from_json(out.read_text())


# -- verl ---------------------------------------------------------------------------------------------


def test_a_verl_dump_scores_as_the_rollouts_were_sampled(rollouts, tmp_path):
    """dump_batch carries prompts without padding, responses, and meta_info's temperature: the
    training forward reproduces the reference engine's logprobs bit for bit."""
    dump = verl.dump_batch(verl_batch(rollouts), tmp_path / "step.parquet")
    report = score(dump, tmp_path, "--model", "tiny-llama", "--dtype", "float32")
    assert report.summary["num_tokens"] == sum(len(r.token_ids) for r in rollouts)
    assert report.summary["max_abs_logprob_diff"] == 0.0
    # negative control: meta_info says another temperature, and the scored distribution moves
    wrong = verl.dump_batch(verl_batch(rollouts, temperature=1.0), tmp_path / "wrong.parquet")
    assert score(wrong, tmp_path, "--model", "tiny-llama", "--dtype", "float32").summary[
        "max_abs_logprob_diff"] > 1e-3


def test_a_verl_dump_holds_the_rollouts_and_the_trainer_logprobs(rollouts, tmp_path):
    dump = read_dump(verl.dump_batch(verl_batch(rollouts), tmp_path / "step.jsonl"))
    assert dump.trainer_column == "trainer_logprobs"
    for r, got, trainer in zip(rollouts, dump.rollouts, dump.trainer_logprobs):
        assert (got.request_id, got.prompt_ids, got.token_ids) == (r.request_id, r.prompt_ids, r.token_ids)
        assert got.logprobs == tuple(float(np.float32(x)) for x in r.logprobs)
        assert got.sampling.temperature == TEMPERATURE and got.logprobs_mode == "processed"
        assert trainer == tuple(trainer_logprobs(r).tolist())
    assert [r.sample_index for r in dump.rollouts] == [r.sample_index for r in rollouts]
    report = score(tmp_path / "step.jsonl", tmp_path, "--trainer-logprobs")  # no forward
    assert report.summary["max_abs_logprob_diff"] > 0


def test_a_multi_turn_verl_batch_keeps_its_tool_tokens_out(rollouts, tmp_path):
    batch = verl_batch(rollouts, tool_tokens=2)
    dump = read_dump(verl.dump_batch(batch, tmp_path / "mt.parquet"))
    for r, got in zip(rollouts, dump.rollouts):
        assert got.token_ids == r.token_ids
        assert got.response_mask == tuple(0 if 1 <= t <= 2 else 1 for t in range(len(r.token_ids)))
    with parity.Monitor(tmp_path / "m", advice_every=0, render_every=0) as monitor:
        record = verl.log_batch(monitor, 0, batch)
    counted = sum(len(r.token_ids) - min(2, len(r.token_ids) - 1) for r in rollouts)
    assert record["summary"]["num_tokens"] == counted


def test_log_batch_logs_what_monitor_log_logs(rollouts, tmp_path):
    batch = verl_batch(rollouts)
    with parity.Monitor(tmp_path / "a", advice_every=0, render_every=0) as a, \
            parity.Monitor(tmp_path / "b", advice_every=0, render_every=0) as b:
        got = verl.log_batch(a, 3, batch, meta={"epoch": 1})
        t = batch.batch
        want = b.log(3, rollout_log_probs=t["rollout_log_probs"], old_log_probs=t["old_log_probs"],
                     response_mask=t["response_mask"], responses=t["responses"])
    for key in ("summary", "rollout_corr", "by_position"):
        assert got[key] == want[key]
    assert got["sampling"] == {"temperature": TEMPERATURE} and got["meta"] == {"epoch": 1}
    assert [w["token_id"] for w in got["worst_tokens"]] == [w["token_id"] for w in want["worst_tokens"]]


def test_verl_batches_that_cannot_be_read_are_named_errors(rollouts, tmp_path):
    monitor = parity.Monitor(tmp_path, advice_every=0, render_every=0)
    try:
        bypass = verl_batch(rollouts)
        bypass.batch["old_log_probs"] = bypass.batch["rollout_log_probs"]
        with pytest.raises(InputError, match="bypass mode"):
            verl.log_batch(monitor, 0, bypass)
        view = verl_batch(rollouts)
        view.batch["old_log_probs"] = view.batch["rollout_log_probs"].view_as(view.batch["rollout_log_probs"])
        with pytest.raises(InputError, match="bypass mode"):
            verl.log_batch(monitor, 0, view)
        missing = verl_batch(rollouts)
        del missing.batch["rollout_log_probs"]
        with pytest.raises(InputError, match=r"calculate_log_probs=True"):
            verl.log_batch(monitor, 0, missing)
        with pytest.raises(InputError, match=r"has \.batch"):
            verl.log_batch(monitor, 0, {"rollout_log_probs": 1})
        with pytest.raises(InputError, match=r"temperature=1\.0 was given but the batch says 0\.7"):
            verl.log_batch(monitor, 0, verl_batch(rollouts), sampling={"temperature": 1.0})
        assert monitor.last_step is None
    finally:
        monitor.close()
    no_temperature = verl_batch(rollouts)
    no_temperature.meta_info.clear()
    with pytest.raises(InputError, match="depend on the temperature"):
        verl.dump_batch(no_temperature, tmp_path / "x.parquet")
    verl.dump_batch(no_temperature, tmp_path / "raw.parquet", logprobs_mode="raw")  # raw needs none
    no_prompts = verl_batch(rollouts)
    del no_prompts.batch["attention_mask"]
    with pytest.raises(InputError, match="attention_mask"):
        verl.dump_batch(no_prompts, tmp_path / "x.parquet")
    not_logprobs = verl_batch(rollouts)
    not_logprobs.batch["rollout_log_probs"][1, 0] = 0.5
    with pytest.raises(InputError, match=r"row 1: rollout logprob 0 is 0\.5"):
        verl.dump_batch(not_logprobs, tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()


# -- NeMo-RL and slime: the same step, their keys -------------------------------------------------------


@pytest.mark.parametrize("framework, data", [(nemo_rl, nemo_rl_data), (slime, slime_data)])
def test_nemo_rl_and_slime_read_the_same_step_as_verl(rollouts, tmp_path, framework, data):
    """Their batches, in their own layouts, give verl's arrays, verl's dump and verl's record."""
    want = verl.read_batch(verl_batch(rollouts))
    got = framework.read_batch(data(rollouts), sampling={"temperature": TEMPERATURE})
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    valid = want.mask
    np.testing.assert_array_equal(got.rollout[valid], want.rollout[valid])
    np.testing.assert_array_equal(got.trainer[valid], want.trainer[valid])
    np.testing.assert_array_equal(np.where(valid, got.responses, 0), np.where(valid, want.responses, 0))
    assert [list(p) for p in got.prompts] == [list(p) for p in want.prompts]
    theirs = read_dump(framework.dump_batch(data(rollouts), tmp_path / "d.jsonl",
                                            sampling={"temperature": TEMPERATURE}))
    ours = read_dump(verl.dump_batch(verl_batch(rollouts), tmp_path / "v.jsonl"))
    assert [(r.prompt_ids, r.token_ids, r.logprobs, r.sampling) for r in theirs.rollouts] == \
        [(r.prompt_ids, r.token_ids, r.logprobs, r.sampling) for r in ours.rollouts]
    assert theirs.trainer_logprobs == ours.trainer_logprobs
    with parity.Monitor(tmp_path / "a", advice_every=0, render_every=0) as a, \
            parity.Monitor(tmp_path / "b", advice_every=0, render_every=0) as b:
        mine = framework.log_batch(a, 0, data(rollouts), sampling={"temperature": TEMPERATURE})
        base = verl.log_batch(b, 0, verl_batch(rollouts))
    assert mine["summary"] == base["summary"] and mine["rollout_corr"] == base["rollout_corr"]


def test_nemo_rl_sample_mask_and_slime_lengths(rollouts, tmp_path):
    data = nemo_rl_data(rollouts)
    data["sample_mask"][0] = 0
    step = nemo_rl.read_batch(data)
    assert not step.mask[0].any() and step.mask[1:].any(axis=1).all()
    bad = slime_data(rollouts)
    bad["log_probs"][2] = bad["log_probs"][2][:-1]
    with pytest.raises(InputError, match="sample 2: log_probs has"):
        slime.read_batch(bad)
    with pytest.raises(InputError, match="train_data has no 'prev_logprobs'"):
        nemo_rl.read_batch({k: v for k, v in nemo_rl_data(rollouts).items() if k != "prev_logprobs"})


# -- no pandas --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_nothing_needs_pandas(tmp_path):
    """With pandas unimportable: a verl-style Parquet dataset written by pandas (its schema carries
    pandas metadata) reads, a batch dumps to Parquet and reads back, and the monitor logs it."""
    code = textwrap.dedent(f"""
        import sys

        class NoPandas:                         # `import pandas` fails as if it were not installed
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "pandas":
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

        sys.meta_path.insert(0, NoPandas())
        try:
            import pandas
            raise SystemExit("pandas imported")
        except ImportError:
            pass
        import json, numpy as np, pyarrow as pa, pyarrow.parquet as pq
        from pathlib import Path
        from parity.workload.prompts import Dataset
        from parity.rollouts.dumps import read_dump
        import parity
        from parity.integrations.batches import StepBatch, dump_step
        out = Path({str(tmp_path)!r})
        meta = {{b"pandas": json.dumps({{"index_columns": ["__index_level_0__"], "columns": []}}).encode()}}
        table = pa.table({{"prompt": [[5, 6, 7], [8, 9]], "__index_level_0__": [0, 1]}})
        table = table.replace_schema_metadata(meta)
        pq.write_table(table, out / "train.parquet")
        assert [p for _, p in Dataset(out / "train.parquet").rows()] == [[5, 6, 7], [8, 9]]
        step = StepBatch(rollout=np.full((2, 3), -1.0, np.float32), trainer=np.full((2, 3), -1.1, np.float32),
                         mask=np.array([[1, 1, 0], [1, 1, 1]], bool), lengths=np.array([2, 3]),
                         responses=np.ones((2, 3), np.int64), prompts=[np.array([5]), np.array([6, 7])],
                         sampling={{"temperature": 1.0}})
        assert len(read_dump(dump_step(step, out / "d.parquet")).rollouts) == 2
        with parity.Monitor(out / "m", render_every=1) as m:
            m.log(0, rollout_log_probs=step.rollout, old_log_probs=step.trainer, response_mask=step.mask)
        print("OK")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            timeout=300, check=False)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]
    assert (tmp_path / "m" / "index.html").exists()  # the page was drawn too


# -- issue 53 item 7: one rule for log_batch and dump_batch, the output path first, the user's temperature


def test_dump_batch_checks_its_path_before_anything(rollouts, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for bad, says in ((tmp_path, "is a directory"), (blocker / "step.parquet", "a file is in the way")):
        with pytest.raises(ConfigError, match=f"dump path .*{says}"):
            verl.dump_batch(verl_batch(rollouts), bad)


def test_a_counted_minus_inf_is_outside_the_support_for_log_and_dump_alike(rollouts, tmp_path):
    batch = verl_batch(rollouts)
    batch.batch["rollout_log_probs"][1, 0] = -np.inf
    with parity.Monitor(tmp_path / "m", advice_every=0, render_every=0) as monitor:
        record = verl.log_batch(monitor, 0, batch)
    assert record["summary"]["num_tokens_outside_support"] == 1
    dump = read_dump(verl.dump_batch(batch, tmp_path / "step.jsonl"))  # JSONL keeps -inf losslessly
    assert dump.rollouts[1].logprobs[0] == -np.inf
    report = score(tmp_path / "step.jsonl", tmp_path, "--trainer-logprobs")
    assert report.summary["num_tokens_outside_support"] == 1
    # negative control: NaN and +inf are no logprobs, in either reader
    for junk in (np.nan, np.inf):
        batch.batch["rollout_log_probs"][1, 0] = junk
        with pytest.raises(InputError, match="row 1: rollout logprob 0"):
            verl.dump_batch(batch, tmp_path / "bad.jsonl")


@pytest.mark.parametrize("temperature", [torch.tensor(0.7), np.float32(0.7),
                                         torch.tensor(0.7, dtype=torch.float16)])
def test_a_scalar_temperature_is_stored_as_the_user_wrote_it(rollouts, tmp_path, temperature):
    batch = verl_batch(rollouts, temperature=temperature)
    with parity.Monitor(tmp_path / "m", advice_every=0, render_every=0) as monitor:
        assert verl.log_batch(monitor, 0, batch)["sampling"] == {"temperature": 0.7}
    dump = read_dump(verl.dump_batch(batch, tmp_path / "step.jsonl"))
    assert dump.rollouts[0].sampling.temperature == 0.7
