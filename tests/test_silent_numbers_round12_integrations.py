"""Round 12, trainer integrations: what their dumps say and what their steps count.

NeMo-RL's dump reads the logprobs mode of the generation config it ran (vLLM's raw when
vllm_cfg.logprobs_mode is absent); a dump that leaves out rows with no counted token says so on the
`parity.monitor` logger; slime counts samples whose loss_masks are all 0 and refuses a processed dump
of SGLang's untruncated logprobs under top-p/top-k. Batches are small NumPy stand-ins; no engine."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from parity.core.errors import InputError
from parity.integrations import nemo_rl, slime


def nemo_data() -> dict:
    """Two whole sequences; sample_mask drops the second (NeMo-RL's seq-logprob-error masking)."""
    ids = np.array([[1, 2, 3, 4, 0], [1, 2, 5, 6, 7]])
    token_mask = np.array([[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    return {"input_ids": ids, "token_mask": token_mask, "input_lengths": np.array([4, 5]),
            "generation_logprobs": np.where(token_mask, -0.5, 0.0).astype(np.float32),
            "prev_logprobs": np.where(token_mask, -0.6, 0.0).astype(np.float32),
            "sample_mask": np.array([1.0, 0.0])}


def slime_data() -> dict:
    """Two samples; the second's loss_masks are all 0 (slime's remove_sample)."""
    return {"tokens": [[1, 2, 3, 4], [1, 2, 5, 6]],
            "rollout_log_probs": [np.array([-0.5, -0.5]), np.array([-0.5, -0.4])],
            "log_probs": [np.array([-0.6, -0.6]), np.array([-0.6, -0.4])],
            "loss_masks": [np.array([1, 1]), np.array([0, 0])]}


def modes(path) -> list[str]:
    return [json.loads(line)["logprobs_mode"] for line in path.read_text().splitlines()]


def vllm_generation(mode: str | None) -> dict:
    """NeMo-RL's policy.generation config, vllm_cfg.logprobs_mode set or absent."""
    return {"backend": "vllm", "vllm_cfg": {} if mode is None else {"logprobs_mode": mode}}


@pytest.mark.parametrize("config, want", [(vllm_generation(None), "raw"),
                                          (vllm_generation("raw_logprobs"), "raw"),
                                          (vllm_generation("processed_logprobs"), "processed"),
                                          ({"backend": "megatron"}, "processed")])
def test_nemo_rl_dump_reads_the_mode_its_generation_ran(tmp_path, config, want):
    out = nemo_rl.dump_batch(nemo_data(), tmp_path / "d.jsonl", sampling={"temperature": 0.7},
                             generation_config=config)
    assert modes(out) == [want]


def test_nemo_rl_dump_refuses_a_mode_its_config_contradicts(tmp_path):
    with pytest.raises(InputError, match="logprobs_mode='processed' but generation_config generates 'raw'"):
        nemo_rl.dump_batch(nemo_data(), tmp_path / "d.jsonl", sampling={"temperature": 0.7},
                           logprobs_mode="processed", generation_config=vllm_generation(None))
    with pytest.raises(InputError, match=r"backend='trtllm'.*pass logprobs_mode"):
        nemo_rl.dump_batch(nemo_data(), tmp_path / "d.jsonl", sampling={"temperature": 0.7},
                           generation_config={"backend": "trtllm"})
    with pytest.raises(InputError, match=r"policy\.generation"):
        nemo_rl.dump_batch(nemo_data(), tmp_path / "d.jsonl", sampling={"temperature": 0.7},
                           generation_config={"vllm_cfg": {}})


def test_nemo_rl_dump_without_a_config_keeps_its_documented_default(tmp_path):
    out = nemo_rl.dump_batch(nemo_data(), tmp_path / "d.jsonl", sampling={"temperature": 0.7})
    assert modes(out) == ["processed"]
    raw = nemo_rl.dump_batch(nemo_data(), tmp_path / "r.jsonl",
                             sampling={"temperature": 0.7, "logprobs_mode": "raw"})
    assert modes(raw) == ["raw"]


def test_a_dump_says_how_many_rows_it_leaves_out(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="parity.monitor"):
        out = nemo_rl.dump_batch(nemo_data(), tmp_path / "d.jsonl", sampling={"temperature": 0.7})
    assert len(out.read_text().splitlines()) == 1
    said = [r.getMessage() for r in caplog.records if r.name == "parity.monitor"]
    assert len(said) == 1 and "leaves out 1 of 2 rows" in said[0]
    assert "nemo_rl_sample_mask_dropped_tokens" in said[0]
    caplog.clear()
    data = nemo_data()
    data["sample_mask"] = np.ones(2)
    with caplog.at_level(logging.WARNING, logger="parity.monitor"):
        nemo_rl.dump_batch(data, tmp_path / "all.jsonl", sampling={"temperature": 0.7})
    assert not [r for r in caplog.records if r.name == "parity.monitor"]


def test_slime_counts_samples_its_loss_masks_take_out(tmp_path, caplog):
    step = slime.read_batch(slime_data(), sampling={"temperature": 1.0})
    assert step.notes == {slime.MASKED: 1}
    full = slime_data()
    full["loss_masks"][1] = np.array([0, 1])  # a partly masked sample is still measured
    assert slime.read_batch(full).notes is None
    with caplog.at_level(logging.WARNING, logger="parity.monitor"):
        slime.dump_batch(slime_data(), tmp_path / "s.jsonl", sampling={"temperature": 1.0})
    assert any("leaves out 1 of 2 rows" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("extra", [{"top_p": 0.9}, {"top_k": 20}])
def test_slime_processed_dump_refuses_sglang_truncation(tmp_path, extra):
    with pytest.raises(InputError, match="SGLang's logprobs are temperature-scaled but not truncated"):
        slime.dump_batch(slime_data(), tmp_path / "s.jsonl", sampling={"temperature": 1.0, **extra})
    raw = slime.dump_batch(slime_data(), tmp_path / "r.jsonl", sampling={"temperature": 1.0, **extra},
                           logprobs_mode="raw")
    assert modes(raw) == ["raw"]
    off = slime.dump_batch(slime_data(), tmp_path / "o.jsonl",
                           sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1})
    assert modes(off) == ["processed"]
