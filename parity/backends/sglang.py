"""SGLang through its offline `Engine` API, or a running server's native `/generate` endpoint.

SGLang's logprobs are log_softmax(logits / T), temperature-scaled but not truncated (raw with
`SGLANG_RETURN_ORIGINAL_LOGPROB=1`, process-wide): so processed logprobs under top-k/top-p are
refused, as parity cannot renormalize without the full distribution. A server needs no sglang package
here; requests go one sample per `/generate` call through `parity.backends.http`. What ran where
(a 0.5.23 server on CPU, 0.5.17 on the H200; `sampling_seed` honoured only in deterministic mode) is
in docs/BACKENDS.md.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parity.backends.base import Backend, SampleJob, TopKRows, expand_samples, stop_set
from parity.backends.http import Endpoint, HttpClient, HttpSettings, check_served_checkpoint
from parity.backends.sglang_probe import SAMPLED_LOGITS, PassDumps, probe_samples
from parity.backends.sglang_server import split_server_args, start_server
from parity.core.errors import BackendError, ConfigError, InputError, UnsupportedError
from parity.core.schema import LOGPROBS_MODES
from parity.core.strict import check_choice
from parity.core.turns import Generate, check_top_k_turns
from parity.core.types import Pair, Request, Rollout, SamplingParams

#: parity logprobs_mode -> the value SGLANG_RETURN_ORIGINAL_LOGPROB must have in the server.
ORIGINAL_LOGPROB_ENV = {"raw": "1", "processed": "0"}
#: SGLang samples a temperature in [0, this) greedily at temperature 1 (SamplingParams.__post_init__,
#: `_SAMPLING_EPS`): its logprobs are then raw ones, whatever was asked.
SGLANG_MIN_TEMPERATURE = 1e-6
#: neutral values of the sampling knobs parity has no field for: sent explicitly, so a server's
#: `--preferred-sampling-params` (merged under every `/generate` request's own) cannot apply its own.
NEUTRAL_SAMPLING = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}
#: SGLang's `--dtype` spellings -> parity's dtype ("auto" resolves in the server, unknown here).
SGLANG_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
                 "float32": "float32"}
#: SGLang clamps every logprob it returns to its dtype's lowest finite value (`clamp_(min=finfo.min)`, so
#: no -inf reaches JSON): float32's -3.4e38, or bfloat16's -3.39e38. A value at or below this stands for -inf.
SGLANG_LOGPROB_FLOOR = -3.3895313892515355e38
#: SGLang's finish reasons of a sample that ran as asked; "abort" (`/abort_request`, `/pause_generation`)
#: ends it early, at a point no parity sampling chose.
FINISHED_AS_ASKED = ("stop", "length")
#: `/get_server_info` fields that decide a server's numbers (recorded in meta["server_settings"]).
SERVER_SETTINGS = ("tp_size", "attention_backend", "sampling_backend", "enable_deterministic_inference",
                   "disable_radix_cache", "disable_cuda_graph", "random_seed", "dtype", "page_size",
                   "kv_cache_dtype", "quantization", "speculative_algorithm")


def translate_sampling(job: SampleJob, eos_ids: Sequence[int], logprobs_mode: str) -> dict[str, Any]:
    """parity sampling for one sample -> SGLang `sampling_params` (a JSON object)."""
    sp = job.sampling
    if sp.logprobs_mode != logprobs_mode:
        raise ConfigError(
            f"request {job.request.request_id!r} asks for logprobs_mode={sp.logprobs_mode!r} but this "
            f"SGLang backend reports {logprobs_mode!r} (SGLANG_RETURN_ORIGINAL_LOGPROB is process-wide); "
            f"start the backend with logprobs_mode={sp.logprobs_mode!r}")
    truncated = sp.top_k > 0 or sp.top_p < 1.0
    if sp.logprobs_mode == "processed" and sp.temperature > 0 and truncated:
        raise ConfigError(
            f"request {job.request.request_id!r}: SGLang's logprobs are temperature-scaled but not "
            f"truncated, so processed logprobs under top_k={sp.top_k}, top_p={sp.top_p} cannot be "
            "reported; use top_k=0 and top_p=1, or logprobs_mode='raw'")
    if 0 < sp.temperature < SGLANG_MIN_TEMPERATURE:
        raise ConfigError(
            f"request {job.request.request_id!r}: sampling.temperature={sp.temperature} is below "
            f"{SGLANG_MIN_TEMPERATURE}, which SGLang samples greedily at temperature 1 (reporting raw "
            f"logprobs); use temperature=0 (greedy) or at least {SGLANG_MIN_TEMPERATURE}")
    if sp.ignore_eos and sp.stop_token_ids:
        raise ConfigError(
            f"request {job.request.request_id!r}: SGLang's ignore_eos also ignores stop_token_ids "
            f"{list(sp.stop_token_ids)} (its samples would run past them); drop ignore_eos or the stop ids")
    return {
        "max_new_tokens": sp.max_tokens, "min_new_tokens": 0, "temperature": sp.temperature,
        "top_p": sp.top_p, "top_k": sp.top_k if sp.top_k > 0 else -1, "sampling_seed": job.seed,
        "stop_token_ids": list(stop_set(sp, eos_ids)), "ignore_eos": sp.ignore_eos, "n": 1,
        "skip_special_tokens": False, **NEUTRAL_SAMPLING,
    }


def unclamp(logprob: Any) -> float:
    """SGLang's clamped -inf (`SGLANG_LOGPROB_FLOOR`) back to -inf, what the other engines report; a null
    (orjson's NaN) is refused."""
    if logprob is None:
        raise BackendError("SGLang returned a null logprob (a NaN, which its JSON encoder writes as null)")
    value = float(logprob)
    return float("-inf") if value <= SGLANG_LOGPROB_FLOOR else value


def engine_eos_ids(model_path: Path) -> tuple[int, ...]:
    """The EOS ids SGLang stops on unless `ignore_eos` (`ModelConfig._get_hf_eos_token_id`): config.json's
    and generation_config.json's together, where vLLM and parity take generation_config.json's alone."""
    ids: dict[int, None] = {}
    for name in ("config.json", "generation_config.json"):
        data = json.loads((model_path / name).read_text()) if (model_path / name).is_file() else None
        eos = data.get("eos_token_id") if isinstance(data, dict) else None
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        ids.update(dict.fromkeys(int(e) for e in eos))
    return tuple(ids)


def check_engine_stops(job: SampleJob, eos_ids: Sequence[int], engine_eos: Sequence[int]) -> None:
    """ConfigError, before the sample is sent, where SGLang would stop on an EOS id of config.json that
    the request's stop set (vLLM's rule: generation_config.json's and the tokenizer's EOS) lacks."""
    if job.sampling.ignore_eos:
        return
    stops = stop_set(job.sampling, eos_ids)
    extra = [i for i in engine_eos if i not in stops]
    if extra:
        raise ConfigError(
            f"request {job.request.request_id!r}: SGLang stops on config.json's eos_token_id {extra} too, "
            f"which the stop set of vLLM and parity ({list(stops)}: generation_config.json's and the "
            f"tokenizer's EOS) lacks, so its samples could end where theirs run on; add {extra} to "
            "sampling.stop_token_ids (every backend then stops there), or set ignore_eos")


def check_finish(out: dict[str, Any], job: SampleJob, tokens: Sequence[int], stops: Sequence[int]) -> None:
    """BackendError for a sample SGLang aborted, or stopped on a token outside `stops` (the stop set
    parity sent): its tokens would pass for one that ran to its length; or holding a stop id before
    its last token (SGLang ran past a stop, or the ids are shifted: no min_new_tokens, no stop strings)."""
    n_tokens = len(tokens)
    finish = out.get("meta_info", {}).get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    where = f"SGLang ended sample {job.request.request_id!r}/{job.sample_index}"
    if kind is not None and kind not in FINISHED_AS_ASKED:
        raise BackendError(f"{where} with finish_reason {finish!r} after {n_tokens} tokens (an abort, "
                           "e.g. /abort_request or /pause_generation): not a sample to a stop id or "
                           "max_new_tokens; run it again while nothing else aborts the server's requests")
    matched = finish.get("matched") if isinstance(finish, dict) else None
    if kind == "stop" and isinstance(matched, int) and matched not in stops:
        raise BackendError(f"{where} on token {matched}, which is not in the stop set parity sent "
                           f"{list(stops)}: SGLang also stops on every EOS id of config.json and "
                           "generation_config.json, parity on generation_config.json's alone; add "
                           f"{matched} to sampling.stop_token_ids so every backend stops there")
    early = next((i for i, token in enumerate(tokens[:-1]) if token in stops), None)
    if early is not None:
        raise BackendError(f"{where} holding stop id {tokens[early]} at position {early} of its {n_tokens} "
                           f"tokens (stop set {list(stops)}): SGLang sampled past a stop parity sent, or its "
                           "token ids are misaligned; its later tokens answer no parity sampling")
    if kind == "stop" and (not tokens or tokens[-1] not in stops):
        raise BackendError(f"{where} with finish_reason {finish!r} on a last token outside the stop set "
                           f"parity sent {list(stops)} (e.g. a stop string of the server's "
                           "--preferred-sampling-params): parity would record it as 'length'")


def decode_routes(encoded: str, moe_layers: int, top_k: int) -> np.ndarray:
    """SGLang's base64 `routed_experts` -> int32 `[positions, moe_layers, top_k]`."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if flat.size % (moe_layers * top_k):
        raise BackendError(f"routed_experts holds {flat.size} ints, not a multiple of moe_layers x top_k "
                           f"= {moe_layers} x {top_k}")
    return flat.reshape(-1, moe_layers, top_k)


def parse_output(out: dict[str, Any], routes_shape: tuple[int, int] | None = None
                 ) -> tuple[list[int], list[float], np.ndarray | None]:
    """One `/generate` result -> (token ids, logprobs, routed experts or None); the logprob tuples
    must name the tokens of `output_ids` (else the response was truncated or reordered)."""
    info = out.get("meta_info")
    if not isinstance(info, dict) or "output_token_logprobs" not in info:
        raise BackendError("SGLang output has no meta_info.output_token_logprobs; send return_logprob=true")
    entries = info["output_token_logprobs"]
    tokens = [int(entry[1]) for entry in entries]
    if "output_ids" in out and list(out["output_ids"]) != tokens:
        raise BackendError(f"SGLang output_ids {out['output_ids']} disagree with the token ids of "
                           f"output_token_logprobs {tokens}")
    logprobs = [unclamp(entry[0]) for entry in entries]
    routes = None
    if info.get("routed_experts") is not None and routes_shape is not None:
        routes = decode_routes(info["routed_experts"], *routes_shape)
    return tokens, logprobs, routes


def parse_top_logprobs(out: dict[str, Any], k: int) -> TopKRows | None:
    """`meta_info.output_top_logprobs` (per position, (logprob, token id, text) entries, most likely
    first; asked for with `top_logprobs_num`) -> parity's top-k rows of k entries; None for k = 0."""
    if not k:
        return None
    rows = out.get("meta_info", {}).get("output_top_logprobs")
    if rows is None:
        raise BackendError("SGLang output has no meta_info.output_top_logprobs; send top_logprobs_num=k with "
                           "return_logprob=true")
    entries = [sorted(row, key=lambda e: -float(e[0]))[:k] for row in rows]
    return [[int(e[1]) for e in row] for row in entries], [[unclamp(e[0]) for e in row] for row in entries]


def parse_prompt_logprobs(out: dict[str, Any], prompt_len: int) -> list[float]:
    """Raw logprobs of the tokens after position `prompt_len` from `input_token_logprobs`."""
    entries = out.get("meta_info", {}).get("input_token_logprobs")
    if entries is None:
        raise BackendError("SGLang output has no meta_info.input_token_logprobs; send return_logprob=true "
                           "with logprob_start_len=0")
    return [unclamp(entry[0]) for entry in entries[prompt_len:]]


def runs_on_cpu(words: Sequence[str], engine_kwargs: Mapping[str, Any]) -> bool:
    """Whether server flags `words` (`--device cpu`) or Engine arguments put SGLang on the CPU."""
    pairs = zip(words, (*words[1:], ""))
    return engine_kwargs.get("device") == "cpu" or any(
        w == "--device=cpu" or (w == "--device" and nxt == "cpu") for w, nxt in pairs)


def _check_logits(jobs: Sequence[SampleJob], capture: Sequence[int], kinds: Sequence[str],
                  on_cpu: bool) -> None:
    """UnsupportedError for the logits of a sampled (temperature > 0) captured sample on a CPU SGLang."""
    if "logits" in kinds and on_cpu and any(jobs[i].sampling.temperature > 0 for i in capture):
        raise UnsupportedError(SAMPLED_LOGITS)


class SGLangBackend(Backend):
    """SGLang `Engine` in this process, or a server at `base_url` (then no engine is started).

    logprobs_mode: "processed" (temperature-scaled) or "raw". api_key_env: the variable holding the
    server's API key (never recorded). concurrency, *_timeout_s, retries: `HttpSettings`.
    launch_server: start a server (`parity.backends.sglang_server`) instead of an Engine; server_args,
    python: its flags and interpreter. engine_kwargs: more `sglang.Engine` arguments, unchanged.
    probe: dump every forward pass's module outputs for `probe` (`parity.backends.sglang_probe`; a
    server or Engine parity starts, radix cache off).
    """

    name = "sglang"
    score_modes = ("raw",)  # SGLang's prompt logprobs (`input_token_logprobs`) are raw only
    bypasses_prefix_cache = True  # by flushing the radix cache before the run (`generate_uncached`)

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", logprobs_mode: str = "processed",
                 base_url: str | None = None, api_key_env: str | None = None,
                 return_routed_experts: bool = False, concurrency: int = 64,
                 request_timeout_s: float = 600.0, run_timeout_s: float = 3600.0, retries: int = 3,
                 engine_kwargs: Mapping[str, Any] | None = None, launch_server: bool = False,
                 server_args: str | Sequence[str] = (), python: str | None = None,
                 start_timeout_s: float = 900.0, probe: bool = False) -> None:
        super().__init__(model, dtype=dtype)
        engine_kwargs = dict(engine_kwargs or {})
        if probe and base_url is not None:
            raise ConfigError("option probe reads the tensor dumps of an SGLang parity starts: drop base_url "
                              "and add launch_server=true (or run the Engine in this process)")
        self.logprobs_mode = check_choice(logprobs_mode, LOGPROBS_MODES, "sglang option logprobs_mode")
        words = split_server_args(server_args)
        if launch_server and (base_url is not None or engine_kwargs):
            raise ConfigError("option launch_server starts a server of its own: drop base_url and "
                              "engine_kwargs (pass launch_server flags in server_args)")
        if not launch_server and (words or python is not None):
            raise ConfigError("options server_args and python apply to a server parity starts; add "
                              "launch_server=true")
        if base_url is None and not launch_server and api_key_env is not None:
            raise ConfigError("option api_key_env applies to a server; give base_url= with it")
        self.return_routed_experts = return_routed_experts
        self.engine_eos = engine_eos_ids(self.model_path)  # what it stops on, said before it starts
        config = json.loads((self.model_path / "config.json").read_text())
        top_k = config.get("num_experts_per_tok")
        # Routes come packed for every decoder layer (the tiny MoE checkpoints are MoE throughout).
        self.routes_shape = (int(config["num_hidden_layers"]), int(top_k)) if top_k else None
        self._engine = None
        self.server = None
        self.on_cpu = runs_on_cpu(words, engine_kwargs)
        self.dumps = PassDumps() if probe else None
        if self.dumps is not None:
            words = (*words, *self.dumps.server_args())
            engine_kwargs = {**engine_kwargs, **({} if launch_server else self.dumps.engine_kwargs())}
        server_info: dict[str, Any] = {}
        try:  # a start that fails leaves no server running and no dump folder behind
            if launch_server:
                self.server = start_server(self.model_path, dtype=dtype,
                                           logprob_env=ORIGINAL_LOGPROB_ENV[logprobs_mode],
                                           routed_experts=return_routed_experts, words=words, python=python,
                                           timeout_s=start_timeout_s)
                base_url = self.server.url
            self.client = None if base_url is None else HttpClient(
                Endpoint.parse(base_url, api_key_env=api_key_env, option="base_url"),
                HttpSettings(concurrency=concurrency, request_timeout_s=request_timeout_s,
                             run_timeout_s=run_timeout_s, retries=retries))
            if self.client is None:
                import sglang  # sglang only for an in-process Engine: a server needs no package here

                os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = ORIGINAL_LOGPROB_ENV[logprobs_mode]
                self._engine = sglang.Engine(model_path=str(self.model_path), skip_tokenizer_init=True,
                                             dtype=dtype, enable_return_routed_experts=return_routed_experts,
                                             **engine_kwargs)
                version = sglang.__version__
            else:
                server_info = self.client.get("/get_server_info")
                where = f"the SGLang server at {self.client.endpoint.public}"
                check_served_checkpoint(server_info.get("model_path"), self.model_path, where)
                served = SGLANG_DTYPES.get(str(server_info.get("dtype")))  # None: "auto" or not shown
                if served is not None and served != dtype:
                    raise ConfigError(f"{where} runs dtype {server_info['dtype']!r} but dtype={dtype!r} was "
                                      f"asked for; pass dtype={served!r}")
                self.meta.update({"served_model_path": server_info.get("model_path"),
                                  "dtype_verified": served is not None, "dtype_source": (
                                      "/get_server_info" if served is not None else
                                      f"declared by the caller, not verified: the server shows dtype "
                                      f"{server_info.get('dtype')!r} (start it with --dtype {dtype})"),
                                  "logprobs_mode_source": "SGLANG_RETURN_ORIGINAL_LOGPROB set by parity"
                                  if self.server is not None else "declared by the caller, not verified: "
                                  "SGLANG_RETURN_ORIGINAL_LOGPROB is the attached server's environment"})
                version = server_info.get("version", "unknown")
                engine_kwargs = {key: server_info[key] for key in SERVER_SETTINGS if key in server_info}
        except BaseException:
            self.close()
            raise
        self.meta.update({
            "backend_version": version, "logprobs_mode": logprobs_mode,
            "sglang_return_original_logprob": ORIGINAL_LOGPROB_ENV[logprobs_mode],
            "engine_eos_ids": list(self.engine_eos),
            "endpoint": "Engine" if self.client is None else self.client.endpoint.public,
            "tensor_parallel_size": engine_kwargs.get("tp_size", 1),
            "attention_backend": engine_kwargs.get("attention_backend", "auto"),
            "batch_invariant": bool(engine_kwargs.get("enable_deterministic_inference", False)),
            "enable_prefix_caching": not engine_kwargs.get("disable_radix_cache", False),
            **({"server_settings": {k: server_info.get(k) for k in SERVER_SETTINGS}} if server_info else {}),
            **({"server_args": list(words)} if self.server is not None else {}),
            "probe": probe,
        })

    def _generate_raw(self, input_ids: list[list[int]], params: list[dict[str, Any]], labels: list[str],
                      **flags: Any) -> list[dict[str, Any]]:
        """One result per sequence, alike from the Engine and from a server."""
        if self._engine is not None:
            return self._engine.generate(input_ids=input_ids, sampling_params=params, **flags)
        bodies = [{"input_ids": ids, "sampling_params": p, **flags} for ids, p in zip(input_ids, params)]
        return self.client.post_many("/generate", bodies, labels)

    def generate(self, requests: Sequence[Request]) -> list[Rollout]:
        return self._run_jobs(expand_samples(requests))

    def _run_jobs(self, jobs: Sequence[SampleJob]) -> list[Rollout]:
        """The samples `jobs` in one call, as rollouts."""
        for job in jobs:
            check_engine_stops(job, self.eos_ids, self.engine_eos)
        params = [translate_sampling(job, self.eos_ids, self.logprobs_mode) for job in jobs]
        k = max((job.sampling.top_k_logprobs for job in jobs), default=0)
        outputs = self._generate_raw([list(job.request.prompt_ids) for job in jobs], params,
                                     [f"{job.request.request_id}/{job.sample_index}" for job in jobs],
                                     return_logprob=True, return_routed_experts=self.return_routed_experts,
                                     **({"top_logprobs_num": k} if k else {}))
        return [self._rollout(job, out) for job, out in zip(jobs, outputs)]

    def _rollout(self, job: SampleJob, out: dict[str, Any]) -> Rollout:
        tokens, logprobs, routes = parse_output(out, self.routes_shape)
        check_finish(out, job, tokens, stop_set(job.sampling, self.eos_ids))
        if routes is not None and routes.shape[0] != len(job.request.prompt_ids) + len(tokens) - 1:
            raise BackendError(f"SGLang routed_experts has {routes.shape[0]} positions for prompt "
                               f"{len(job.request.prompt_ids)} + tokens {len(tokens)} - 1")
        top_k = parse_top_logprobs(out, job.sampling.top_k_logprobs)
        cached = out["meta_info"].get("cached_tokens")
        return self.finished(job, tokens, logprobs, routes, top_k=top_k,
                             **({} if cached is None else {"num_cached_tokens": int(cached)}))

    def probe(self, requests: Sequence[Request], capture: Sequence[int], kinds: Sequence[str]
              ) -> tuple[list[Rollout], dict[int, dict[str, torch.Tensor]]]:
        """The samples of `requests` one at a time (SGLang dumps per forward pass, not per request),
        with stages `kinds` of the samples `capture` read from the dumps: per index {stage: [rows,
        width]} in the dtype SGLang computed."""
        if self.dumps is None:
            raise ConfigError("this SGLang backend was started without the probe; start it with probe=True")
        jobs = expand_samples(requests)
        _check_logits(jobs, capture, kinds, self.on_cpu)

        def flush() -> None:
            self._generate_raw([list(jobs[0].request.prompt_ids[:1])], [{"max_new_tokens": 1}], ["flush"])

        return probe_samples(self.dumps, jobs, capture, kinds, lambda i: self._run_jobs([jobs[i]])[0], flush)

    def generate_uncached(self, requests: Sequence[Request]) -> list[Rollout]:
        """`generate` after flushing the radix cache (no per-request bypass: requests of one call may
        still share a prefix, `num_cached_tokens` says)."""
        if self.has_prefix_cache:
            self.flush_cache()
        return self.generate(requests)

    def flush_cache(self) -> None:
        """Empty the radix cache (`Engine.flush_cache` or the server's `/flush_cache`)."""
        if self._engine is not None:
            self._engine.flush_cache()
        else:
            self.client.post("/flush_cache", text=True)

    @classmethod
    def check_requests(cls, requests: Sequence[Request], options: dict[str, Any]) -> None:
        """`translate_sampling`'s refusals (a logprobs mode other than the backend's, processed
        logprobs under top-k/top-p, a temperature SGLang samples greedily, stop ids under ignore_eos,
        a turn's included) before a server or Engine starts; trajectories are checked, not refused."""
        mode = options.get("logprobs_mode", "processed")
        for request in requests:  # per request: samples and turns differ in seed, length and stops only
            stops = [t.stop_token_ids for t in request.turns if isinstance(t, Generate)]
            sampling = request.sampling.replace(
                stop_token_ids=tuple(dict.fromkeys(request.sampling.stop_token_ids + sum(stops, ()))))
            translate_sampling(SampleJob(dataclasses.replace(request, sampling=sampling), 0, 0), (), mode)
        check_top_k_turns(requests)  # the rows of a trajectory's last turn only

    @classmethod
    def check_probe(cls, requests: Sequence[Request], capture: Sequence[int], kinds: Sequence[str],
                    options: dict[str, Any]) -> None:
        """What `probe` would refuse with these start `options`, before the start: sampled logits on CPU."""
        words = split_server_args(options.get("server_args", ()))
        _check_logits(expand_samples(requests), capture, kinds,
                      runs_on_cpu(words, dict(options.get("engine_kwargs") or {})))

    @classmethod
    def top_k_limit(cls, options: dict[str, Any]) -> int | None:
        return None  # `top_logprobs_num` has no cap below the vocabulary

    def _score(self, pairs: list[Pair], sampling: SamplingParams) -> list[torch.Tensor]:
        """Raw teacher-forced logprobs from `input_token_logprobs` (SGLang has no processed ones)."""
        params = [{"max_new_tokens": 1, "temperature": 0.0}] * len(pairs)
        outputs = self._generate_raw([[*p, *r] for p, r in pairs], params,
                                     [f"sequences[{i}]" for i in range(len(pairs))], return_logprob=True,
                                     logprob_start_len=0)
        result = []
        for i, ((prompt, response), out) in enumerate(zip(pairs, outputs)):
            values = parse_prompt_logprobs(out, len(prompt))
            if len(values) != len(response):  # e.g. --allow-auto-truncate cut the sequence's tail
                raise BackendError(f"SGLang scored {len(values)} of the {len(response)} response tokens of "
                                   f"sequences[{i}] (input_token_logprobs for {len(prompt) + len(values)} of "
                                   f"{len(prompt) + len(response)} positions); is the sequence longer than "
                                   "the server's context?")
            result.append(torch.tensor(values, dtype=torch.float32))
        return result

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`Engine.update_weights_from_tensor`, then flush the radix (prefix) cache."""
        if self._engine is None:
            raise BackendError("weight updates through a server need a checkpoint on its disk "
                               "(/update_weights_from_disk); parity pushes tensors only to an Engine")
        weights = list(named_tensors)
        if not weights:
            raise InputError("update_weights got no tensors; pass (HF parameter name, tensor) pairs")
        self._engine.update_weights_from_tensor(named_tensors=weights)
        self._engine.flush_cache()

    def close(self) -> None:
        engine, self._engine = self._engine, None
        try:
            if engine is not None:
                engine.shutdown()
            server, self.server = self.server, None
            if server is not None:
                server.stop()
        finally:
            dumps, self.dumps = self.dumps, None
            if dumps is not None:
                dumps.close()
