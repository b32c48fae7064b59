"""Round 5, the training side that scores rollouts: numbers that were silently wrong.

- the sampling probe (`parity.assess.mismatch`) scored its alternatives without the LoRA adapter
  (and router replay) the report's training forward used, so for rollouts recording no adapter
  (`parity score --lora`) it named a wrong temperature with a wrong error;
- `train_forward` given a LoadedModel in another dtype or on another device read its checkpoint
  again, silently scoring the checkpoint instead of the weights the LoadedModel holds;
- the gold verdict called two sides "identical" when only their errors were (mirrored about the gold).
"""

import dataclasses

import numpy as np
import pytest
import torch

from parity.advisor import DATA_BUGS
from parity.assess.accuracy import gold_summary
from parity.assess.mismatch import sampling_findings
from parity.assess.training_side import report_for
from parity.core.errors import ConfigError
from parity.core.types import Request, SamplingParams
from parity.drift.tolerance import Tolerance
from parity.engine import ReferenceEngine, train_forward
from parity.models.loading import copy_model, load_model

pytestmark = pytest.mark.usefixtures("one_thread")

ADAPTER = "tiny-llama-lora-r8"


@pytest.fixture(scope="module")
def adapted_rollouts():
    """Rollouts of tiny-llama + LoRA at temperature 1.0, recorded as 0.5 (a data bug) and with the
    adapter's record dropped, as a dump's rollouts arrive (`parity score --lora`)."""
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=3, ignore_eos=True)
    requests = [Request(tuple(range(10 + 7 * i, 30 + 7 * i)), sampling, f"r{i}") for i in range(4)]
    with ReferenceEngine("tiny-llama", dtype="float32", lora=ADAPTER) as engine:
        rollouts = engine.generate(requests)
    wrong = sampling.replace(temperature=0.5)
    return [dataclasses.replace(r, sampling=wrong, meta={k: v for k, v in r.meta.items() if k != "lora"})
            for r in rollouts]


def test_the_sampling_probe_scores_with_the_adapter_the_report_used(adapted_rollouts):
    train = [lp.numpy() for lp in train_forward("tiny-llama", adapted_rollouts, lora=ADAPTER).logprobs]
    (finding,) = sampling_findings("tiny-llama", adapted_rollouts, train, dtype="float32", device="cpu",
                                   kernels="invariant", lora=ADAPTER)
    # the true temperature, matched exactly (without the adapter: "temperature=1.1 ... 0.562 nats")
    assert "with temperature=1.0 (mean |Δlogp| 0 nats" in finding


def test_a_report_scored_with_a_given_adapter_probes_with_it(adapted_rollouts):
    report = report_for("tiny-llama", adapted_rollouts, dtype="float32", device="cpu", reference="invariant",
                        router_replay=None, tolerance=Tolerance.exact(), provenance={}, gold=False,
                        lora=ADAPTER)
    (finding,) = report.extras[DATA_BUGS]
    assert "with temperature=1.0 (mean |Δlogp| 0 nats" in finding


@pytest.fixture
def trained():
    """A private bfloat16 copy whose weights are no longer the checkpoint's (a policy being trained)."""
    lm = copy_model(load_model("tiny-llama", dtype="bfloat16"))
    with torch.no_grad():
        for p in lm.model.parameters():
            p.mul_(1.5)
    return lm


def test_a_loaded_model_is_scored_in_its_own_dtype_not_replaced_by_its_checkpoint(trained):
    pairs = [((5, 6, 7, 8), (9, 10, 11))]
    own = train_forward(trained, pairs, dtype="bfloat16").logprobs[0]
    checkpoint = train_forward("tiny-llama", pairs, dtype="bfloat16").logprobs[0]
    assert not torch.equal(own, checkpoint)  # the weights it holds are scored
    # before: the default float32 (or any other dtype) silently scored the float32 checkpoint
    with pytest.raises(ConfigError, match=r"LoadedModel in bfloat16 on cpu, but the training forward was "
                                          r"asked for float32 on cpu: it would score the checkpoint"):
        train_forward(trained, pairs)
    with pytest.raises(ConfigError, match=r"pass dtype='bfloat16'"):
        train_forward(trained, pairs, dtype="float16")


def test_a_private_model_copy_is_not_scored_tensor_parallel_from_its_checkpoint(trained):
    """The ranks of a tensor-parallel forward load the checkpoint: a trained copy's weights would not
    reach them (before: the checkpoint's logprobs, silently); refused before any rank starts. The
    shared model of the same checkpoint is its checkpoint, and is_shared says which is which."""
    from parity.models.loading import is_shared

    pairs = [((5, 6, 7, 8), (9, 10, 11))]
    assert is_shared(load_model("tiny-llama", dtype="bfloat16")) and not is_shared(trained)
    with pytest.raises(ConfigError, match=r"loads the checkpoint in every rank.*tensor_parallel_size=None"):
        train_forward(trained, pairs, dtype="bfloat16", tensor_parallel_size=2)


def test_mirrored_errors_are_not_called_identical_logprobs():
    gold = np.array([[-1.0, -2.0, -0.5, -3.0]])
    shift = np.array([[0.01, 0.02, 0.005, 0.03]])
    mask = np.ones_like(gold, dtype=bool)
    summary = gold_summary(gold + shift, gold - shift, gold, mask)
    assert "identical" not in summary["gold/verdict"]
    assert summary["gold/verdict"].startswith("the rollout and the trainer are equally far from the gold "
                                              "within noise")
    same = gold_summary(gold + shift, gold + shift, gold, mask)
    assert same["gold/verdict"].endswith("their logprobs are identical")
