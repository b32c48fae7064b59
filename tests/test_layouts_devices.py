"""No silent wrong numbers: rollouts are scored in the tensor-parallel layout they record, and a
comparison's two sides run on the device asked for (issue 40, items 1 and 2).

A reference engine at TP=2 samples in parity's TP-invariant layout; scoring its rollouts with
the whole-model layout reports the layout's difference (0.09-0.2 nats in bf16) as drift. Each
test here would pass that wrong number on the old code: the negative controls show the two
layouts really differ, so equality is a finding, not an accident.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import parity
from parity.core.errors import ConfigError, InputError
from parity.core.types import Request, SamplingParams
from parity.engine import ReferenceEngine, train_forward
from parity.scoring import score

MODEL = "tiny-llama"
DTYPE = "bfloat16"
REQUESTS = [Request((5 + i, 9, 13, 21 + i), SamplingParams(max_tokens=6, temperature=1.0, seed=i, n=2),
                    request_id=f"r{i}") for i in range(3)]


@pytest.fixture(scope="module")
def tp2_rollouts():
    with ReferenceEngine(MODEL, dtype=DTYPE, tensor_parallel_size=2) as engine:
        return engine.generate(REQUESTS)


@pytest.fixture(scope="module")
def whole_rollouts():
    return ReferenceEngine(MODEL, dtype=DTYPE).generate(REQUESTS)


def _logprobs(rollouts):
    return [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts]


@pytest.mark.slow
def test_tp_rollouts_score_in_their_recorded_layout_bit_for_bit(tp2_rollouts) -> None:
    assert {r.meta["reduction_groups"] for r in tp2_rollouts} == {8}
    scored = train_forward(MODEL, tp2_rollouts, dtype=DTYPE).logprobs
    assert all(torch.equal(a, b) for a, b in zip(scored, _logprobs(tp2_rollouts), strict=True))
    # negative control: the same tokens as bare pairs (no record) go through the whole model, and differ
    pairs = [(r.prompt_ids, r.token_ids) for r in tp2_rollouts]
    whole = train_forward(MODEL, pairs, dtype=DTYPE, temperature=1.0).logprobs
    assert not all(torch.equal(a, b) for a, b in zip(whole, _logprobs(tp2_rollouts), strict=True))


@pytest.mark.slow
def test_a_call_that_contradicts_the_record_is_refused(tp2_rollouts, whole_rollouts) -> None:
    with pytest.raises(ConfigError, match="reduction_groups=4 contradicts the rollouts' record"):
        train_forward(MODEL, tp2_rollouts, dtype=DTYPE, reduction_groups=4)
    with pytest.raises(ConfigError, match="tp_reduction='all_reduce' contradicts"):
        train_forward(MODEL, tp2_rollouts, dtype=DTYPE, tp_reduction="all_reduce")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 contradicts .* whole model"):
        train_forward(MODEL, whole_rollouts, dtype=DTYPE, tensor_parallel_size=2)
    with pytest.raises(InputError, match="different tensor-parallel layouts"):
        train_forward(MODEL, [*tp2_rollouts[:1], *whole_rollouts[:1]], dtype=DTYPE)
    # what the record says, said again, is no contradiction
    again = train_forward(MODEL, tp2_rollouts, dtype=DTYPE, tensor_parallel_size=1,
                          reduction_groups=8).logprobs
    assert all(torch.equal(a, b) for a, b in zip(again, _logprobs(tp2_rollouts), strict=True))


@pytest.mark.slow
def test_compare_tp2_record_scores_exact_with_parity_score(tmp_path) -> None:
    path = tmp_path / "tp2.jsonl"
    sampling = SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=2)
    report = parity.compare(MODEL, "reference", prompts=[[5, 6, 7], [9, 10, 11, 12]], sampling=sampling,
                            dtype=DTYPE, tensor_parallel=2, record=path)
    assert report.summary["max_abs_logprob_diff"] == 0.0 and report.passed
    again = score(path)
    assert again.summary["max_abs_logprob_diff"] == 0.0 and again.passed
    assert np.array_equal(again.train_logprobs, report.train_logprobs)


def test_compare_places_the_backend_on_the_training_device(monkeypatch) -> None:
    """device="cuda" starts a reference or hf backend with device="cuda" (CPU here: the start is
    intercepted, the placement checked); vLLM, which chooses its own device, gets no option."""
    started = []

    class Stop(Exception):
        pass

    def start(name, model, **options):
        started.append((name, options))
        raise Stop

    compare_module = sys.modules["parity.compare"]
    monkeypatch.setattr(compare_module, "_check_device", lambda device: None)
    monkeypatch.setattr(compare_module, "shared_backend", start)
    for backend in ("reference", "hf", "vllm"):
        with pytest.raises(Stop):
            parity.compare(MODEL, backend, prompts=[[3, 4]], device="cuda")
    assert started == [("reference", {"dtype": "bfloat16", "device": "cuda"}),
                       ("hf", {"dtype": "bfloat16", "device": "cuda"}),
                       ("vllm", {"dtype": "bfloat16"})]


def test_a_running_backend_on_another_device_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(sys.modules["parity.compare"], "_check_device", lambda device: None)
    backend = parity.backends.get_backend("reference", MODEL, dtype="float32")
    with pytest.raises(ConfigError, match=r"samples on 'cpu' but device='cuda'.*start the backend with "
                                          r"device='cuda', or pass device='cpu'"):
        parity.compare(MODEL, backend, prompts=[[3, 4]], dtype="float32", device="cuda")
    backend.close()


def test_provenance_records_both_sides_devices() -> None:
    report = parity.compare(MODEL, "reference", prompts=[[3, 4, 5]], sampling={"max_tokens": 3},
                            dtype="float32")
    assert report.provenance["train_device"] == "cpu" and report.provenance["backend_device"] == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_cuda_compare_runs_the_reference_backend_on_cuda_exactly() -> None:
    report = parity.compare(MODEL, "reference", prompts=[[5, 6, 7, 8], [9, 10]],
                            sampling={"max_tokens": 8, "temperature": 1.0, "n": 2}, dtype=DTYPE,
                            device="cuda")
    assert report.provenance["backend_device"] == "cuda" and report.provenance["train_device"] == "cuda"
    assert report.summary["max_abs_logprob_diff"] == 0.0
