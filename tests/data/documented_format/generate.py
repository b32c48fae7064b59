"""Regenerate the SGLang / TensorRT-LLM output files in this directory.

Neither backend runs on these CPU machines, so these are not captures of live runs: they are
outputs written in each backend's documented wire format (SGLang `/generate` `meta_info`,
TensorRT-LLM `CompletionOutput` as JSON) with numbers that follow each backend's documented
logprob definition, computed from the built-in tiny checkpoints:
- sglang_generate.json: tiny-qwen3-moe, logprobs = log_softmax(logits / T) of the sampled
  token (SGLang's temperature-scaled, untruncated definition), routed experts base64 int32 from
  the reference engine's routes; input_token_logprobs raw.
- trtllm_completions.json: tiny-llama, both `logprobs` layouts (floats; dicts token ->
  {logprob, rank}), raw logprobs (TRT-LLM's default), prompt_logprobs raw.

Run: PARITY_CACHE=.venv/parity-cache .venv/bin/python tests/data/documented_format/generate.py
"""

import base64
import json
from pathlib import Path

import numpy as np

from parity.backends import get_backend
from parity.core.types import Request, SamplingParams

HERE = Path(__file__).resolve().parent
PROMPTS = [(1, 40, 41, 42, 43, 44), (1, 70, 71)]


def sglang() -> None:
    reqs = [Request(p, SamplingParams(temperature=0.8, max_tokens=8, seed=5), f"s{i}")
            for i, p in enumerate(PROMPTS)]
    with get_backend("reference", "tiny-qwen3-moe", dtype="float32", record_routes=True) as ref:
        rollouts = ref.generate(reqs)
        raw = ref.score(rollouts, logprobs_mode="raw")
        tempered = ref.score(rollouts, logprobs_mode="processed", temperature=0.8)
        prompt_raw = ref.score([((r.prompt_ids[0],), r.prompt_ids[1:]) for r in rollouts])
    outputs = []
    for r, lps, plps in zip(rollouts, tempered, prompt_raw):
        finish = {"type": "stop", "matched": r.token_ids[-1]} if r.finish_reason == "stop" \
            else {"type": "length", "length": len(r.token_ids)}
        outputs.append({"output_ids": list(r.token_ids), "meta_info": {
            "id": r.request_id, "finish_reason": finish, "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": len(r.token_ids),
            "input_token_logprobs": [[None, r.prompt_ids[0], None]]
            + [[float(v), t, None] for v, t in zip(plps, r.prompt_ids[1:])],
            "output_token_logprobs": [[float(v), t, None] for v, t in zip(lps, r.token_ids)],
            "routed_experts": base64.b64encode(r.routed_experts.astype(np.int32).tobytes()).decode(),
        }})
    doc = {"model": "tiny-qwen3-moe", "sampling": {"temperature": 0.8, "max_tokens": 8, "seed": 5},
           "prompts": [list(p) for p in PROMPTS], "outputs": outputs,
           "expected_raw_logprobs": [s.tolist() for s in raw]}
    (HERE / "sglang_generate.json").write_text(json.dumps(doc, indent=1) + "\n")


def trtllm() -> None:
    reqs = [Request(p, SamplingParams(temperature=1.0, max_tokens=6, seed=9, logprobs_mode="raw"), f"t{i}")
            for i, p in enumerate(PROMPTS)]
    with get_backend("reference", "tiny-llama", dtype="float32") as ref:
        rollouts = ref.generate(reqs)
        prompt_raw = ref.score([((r.prompt_ids[0],), r.prompt_ids[1:] + r.token_ids) for r in rollouts])
    completions = []
    for i, (r, plps) in enumerate(zip(rollouts, prompt_raw)):
        if i == 0:  # simple format: floats
            logprobs = list(r.logprobs)
        else:  # TokenLogprobs: one dict token_id -> Logprob per position
            logprobs = [{str(t): {"logprob": v, "rank": 1}} for t, v in zip(r.token_ids, r.logprobs)]
        ids = r.prompt_ids + r.token_ids
        completions.append({
            "index": 0, "text": "", "token_ids": list(r.token_ids), "logprobs": logprobs,
            "finish_reason": "stop" if r.finish_reason == "stop" else "length",
            "stop_reason": r.token_ids[-1] if r.finish_reason == "stop" else None,
            "prompt_logprobs": [{str(t): {"logprob": float(v), "rank": 1}} for t, v in zip(ids[1:], plps)],
        })
    doc = {"model": "tiny-llama", "sampling": {"temperature": 1.0, "max_tokens": 6, "seed": 9},
           "prompts": [list(p) for p in PROMPTS], "completions": completions,
           "expected_logprobs": [list(r.logprobs) for r in rollouts]}
    (HERE / "trtllm_completions.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    sglang()
    trtllm()
