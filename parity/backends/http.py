"""HTTP to a rollout server, shared by the server backends (vLLM's OpenAI API, SGLang's /generate).

Credentials (an API key from a named environment variable, or user:password in the URL) never
reach what parity writes (`Endpoint.public`). `post_many` keeps `concurrency` requests in flight;
connection errors and 429/502/503/504 are retried with backoff (every sample carries its seed, so
requests are idempotent); a batch with requests that got no answer raises `RequestsLostError` naming
each, never hangs or returns part; a dead server parity started fails it at once; another 4xx is
raised at once with the server's words.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import os
import random
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from parity.core.errors import BackendError, ConfigError
from parity.models import model_hash

#: answers that mean "busy or restarting, try again".
RETRY_STATUSES = frozenset({429, 502, 503, 504})
SCHEMES = ("http", "https")
#: most lost requests named one by one in an error message; the rest are counted.
MAX_NAMED_LOST = 20


@dataclass(frozen=True)
class Endpoint:
    """A server's base URL and how to authenticate; `public` is the form safe to record."""

    url: str
    api_key: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str, *, api_key_env: str | None = None, option: str = "url") -> Endpoint:
        """Check `url` (option name `option` in errors) and read the API key from `api_key_env`."""
        if not isinstance(url, str) or not url:
            raise ConfigError(f"option {option} must be a server URL such as http://127.0.0.1:8000, "
                              f"got {url!r}")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise ConfigError(f"option {option}={_redact(url)!r}: the scheme must be one of {SCHEMES}, "
                              f"got {parts.scheme or 'none'!r}; e.g. http://127.0.0.1:8000")
        if not parts.hostname:
            raise ConfigError(f"option {option}={_redact(url)!r} names no host; e.g. http://127.0.0.1:8000")
        try:
            parts.port  # noqa: B018 - raises ValueError on a malformed port
        except ValueError as e:
            raise ConfigError(f"option {option}={_redact(url)!r}: {e}") from e
        if parts.query or parts.fragment:
            # routes are appended to the URL's path; a query or fragment would end up in front of them
            raise ConfigError(f"option {option}={_redact(url)!r} has a query string or fragment; give the "
                              "server's base URL (scheme://host:port[/path]); an API key goes in the "
                              "environment variable named by api_key_env")
        api_key = None if api_key_env is None else api_key_from_env(api_key_env)
        return cls(url=url.rstrip("/"), api_key=api_key)

    @property
    def public(self) -> str:
        """scheme://host[:port]/path: no user, password, query or fragment."""
        return _redact(self.url)

    @property
    def loopback(self) -> bool:
        """True when the server is on this machine (127.0.0.0/8, ::1 or localhost)."""
        host = urllib.parse.urlsplit(self.url).hostname or ""
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def secrets(self) -> list[str]:
        """Strings that must never appear in a message: the API key and URL credentials."""
        parts = urllib.parse.urlsplit(self.url)
        return [s for s in (self.api_key, parts.password, parts.username) if s]


def api_key_from_env(api_key_env: str) -> str:
    """The API key in environment variable `api_key_env` (option api_key_env); ConfigError if unset."""
    if not isinstance(api_key_env, str) or not api_key_env:
        raise ConfigError(f"option api_key_env must name an environment variable, got {api_key_env!r}")
    api_key = os.environ.get(api_key_env)
    if not api_key:
        raise ConfigError(f"option api_key_env={api_key_env!r}: that environment variable is not set or "
                          "empty; export it with the server's API key")
    return api_key


def check_served_checkpoint(served: object, model_path: Path, where: str) -> None:
    """ConfigError when a server reports loading checkpoint folder `served` (vLLM's `/v1/models` root,
    SGLang's `model_path`), a folder here other than `model_path` whose files differ from it (model
    hash): its logprobs would be compared with another model's training forward. A name, a relative
    path (relative to the server's folder), or a path that is no checkpoint here (a server on another
    machine) cannot be checked and passes."""
    if not isinstance(served, str) or not Path(served).is_absolute():
        return
    folder = Path(served)
    if not (folder / "config.json").is_file() or folder.resolve() == Path(model_path).resolve():
        return
    theirs, ours = model_hash(folder), model_hash(model_path)
    if theirs != ours:
        raise ConfigError(f"{where} serves checkpoint {served!r} (model hash {theirs}), not "
                          f"{str(model_path)!r} (model hash {ours}); pass model={served!r}, or attach the "
                          "server of the model asked for")


def _redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = host if port is None else f"{host}:{port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


@dataclass(frozen=True)
class HttpSettings:
    """Limits for talking to a server (seconds; counts). metadata_timeout_s bounds a GET, so a server
    that never answers is told apart in seconds; run_timeout_s bounds a whole `post_many`; retry i
    waits backoff_s x 2^i x U(0.5, 1)."""

    concurrency: int = 64
    request_timeout_s: float = 600.0
    metadata_timeout_s: float = 30.0
    run_timeout_s: float = 3600.0
    connect_timeout_s: float = 10.0
    retries: int = 3
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        for name, least in (("concurrency", 1), ("retries", 0)):
            value = getattr(self, name)
            if not _is_int(value) or value < least:
                raise ConfigError(f"option {name} must be an integer >= {least}, got {value!r}")
        for name in ("request_timeout_s", "metadata_timeout_s", "run_timeout_s", "connect_timeout_s",
                     "backoff_s"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0 or (value == 0 and name != "backoff_s"):
                bound = ">= 0" if name == "backoff_s" else "> 0"
                raise ConfigError(f"option {name} must be a number of seconds {bound}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class LostRequest:
    """A request that got no answer: its label (e.g. "r3/1" = request r3, sample 1) and why."""

    label: str
    reason: str


class RequestsLostError(BackendError):
    """Some requests of a batch got no answer; `lost` names them, `completed` counts the rest."""

    def __init__(self, endpoint: str, lost: Sequence[LostRequest], total: int) -> None:
        self.lost = tuple(lost)
        self.total = total
        self.completed = total - len(self.lost)
        named = ", ".join(f"{r.label} ({r.reason})" for r in self.lost[:MAX_NAMED_LOST])
        more = f", and {len(self.lost) - MAX_NAMED_LOST} more" if len(self.lost) > MAX_NAMED_LOST else ""
        super().__init__(f"{len(self.lost)} of {total} requests to {endpoint} were lost: {named}{more}")


class _Fatal(Exception):
    """A request that fails however often it is sent (a 4xx but 429, or an answer not JSON)."""


class HttpClient:
    """JSON over HTTP to one server. liveness: None while the server is believed alive, else why it
    is dead; checked before each retry."""

    def __init__(self, endpoint: Endpoint, settings: HttpSettings | None = None, *,
                 liveness: Callable[[], str | None] | None = None) -> None:
        self.endpoint = endpoint
        self.settings = settings or HttpSettings()
        self.liveness = liveness or (lambda: None)

    def get(self, route: str) -> Any:
        """GET `route`; the decoded JSON answer."""
        return self._one("GET", route, None, timeout=self.settings.metadata_timeout_s)

    def get_text(self, route: str) -> str:
        """GET `route`; the answer as text (a Prometheus `/metrics` page)."""
        return self._one("GET", route, None, text=True, timeout=self.settings.metadata_timeout_s)

    def post(self, route: str, body: dict[str, Any] | None = None, *, text: bool = False) -> Any:
        """POST `body` as JSON to `route`; the decoded JSON answer (None for an empty one), or with
        `text` the answer's text (routes that answer in plain text, e.g. vLLM's LoRA endpoints)."""
        return self._one("POST", route, body, text=text)

    def post_many(self, route: str, bodies: Sequence[dict[str, Any]], labels: Sequence[str]) -> list[Any]:
        """POST every body to `route` concurrently; answers in input order."""
        if len(bodies) != len(labels):
            raise ValueError("post_many needs one label per body")
        if not bodies:
            return []
        results = _run(self._batch("POST", route, list(bodies), list(labels)))
        lost = [r for r in results if isinstance(r, LostRequest)]
        if lost:
            raise RequestsLostError(self.endpoint.public, lost, len(bodies))
        return results

    def _one(self, method: str, route: str, body: dict[str, Any] | None, *, text: bool = False,
             timeout: float | None = None) -> Any:
        result = _run(self._batch(method, route, [body], [route], text=text, timeout=timeout))[0]
        if isinstance(result, LostRequest):
            raise BackendError(self._scrub(f"{method} {self.endpoint.public}{route} failed: {result.reason}"))
        return result

    async def _batch(self, method: str, route: str, bodies: list[Any], labels: list[str], *,
                     text: bool = False, timeout: float | None = None) -> list[Any]:
        s = self.settings
        wait = s.request_timeout_s if timeout is None else timeout
        parts = urllib.parse.urlsplit(self.endpoint.url)
        headers = {"Authorization": f"Bearer {self.endpoint.api_key}"} if self.endpoint.api_key else {}
        # user:password from the URL as basic auth, unless an API key (a Bearer token) is given
        auth = (urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")) \
            if parts.username and not self.endpoint.api_key else None
        limits = httpx.Limits(max_connections=s.concurrency, max_keepalive_connections=s.concurrency)
        dead: list[str] = []  # set once: the server is gone, stop retrying everywhere
        semaphore = asyncio.Semaphore(s.concurrency)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.run_timeout_s
        # credentials travel in `headers`/`auth` only (httpx would otherwise apply URL userinfo itself)
        target = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        async with httpx.AsyncClient(base_url=target, headers=headers, auth=auth, limits=limits,
                                     timeout=httpx.Timeout(wait, connect=s.connect_timeout_s),
                                     trust_env=not self.endpoint.loopback) as client:
            tasks = [asyncio.create_task(self._send(client, semaphore, dead, method, route, body, label,
                                                    text, wait))
                     for body, label in zip(bodies, labels)]
            pending: set[asyncio.Task[Any]] = set(tasks)
            failure: BaseException | None = None
            while pending and failure is None and loop.time() < deadline:
                done, pending = await asyncio.wait(pending, timeout=deadline - loop.time(),
                                                   return_when=asyncio.FIRST_EXCEPTION)
                failure = next((t.exception() for t in done if t.exception() is not None), None)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if isinstance(failure, _Fatal):
            raise BackendError(self._scrub(str(failure)))
        if failure is not None:
            raise failure
        return [LostRequest(label, f"no answer before the run timeout of {s.run_timeout_s:g} s")
                if task in pending else task.result() for task, label in zip(tasks, labels)]

    async def _send(self, client: httpx.AsyncClient, semaphore: asyncio.Semaphore, dead: list[str],
                    method: str, route: str, body: Any, label: str, text: bool = False,
                    wait: float | None = None) -> Any:
        s = self.settings
        wait = s.request_timeout_s if wait is None else wait
        async with semaphore:
            attempt = 0
            while True:
                if dead:
                    return LostRequest(label, dead[0])
                try:
                    response = await asyncio.wait_for(client.request(method, route, json=body), wait)
                except (TimeoutError, httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
                    kind = "request" if wait == s.request_timeout_s else "metadata"
                    return LostRequest(label, f"no answer within the {kind} timeout of {wait:g} s")
                except httpx.TransportError as e:
                    reason = f"connection failed ({type(e).__name__}{': ' + str(e) if str(e) else ''})"
                else:
                    if response.status_code < 400:
                        where = f"{self.endpoint.public}{route} ({label})"
                        return response.text if text else _json(response, where)
                    reason = f"HTTP {response.status_code}: {_detail(response)}"
                    if response.status_code not in RETRY_STATUSES:
                        if response.status_code < 500:
                            raise _Fatal(f"{self.endpoint.public}{route} refused request {label}: {reason}")
                        return LostRequest(label, self._scrub(reason))
                gone = self.liveness()
                if gone is not None:
                    dead.append(f"the server died: {gone}")
                    return LostRequest(label, dead[0])
                if attempt >= s.retries:
                    return LostRequest(label, self._scrub(f"{reason}; gave up after {s.retries} retries"))
                await asyncio.sleep(s.backoff_s * 2**attempt * random.uniform(0.5, 1.0))
                attempt += 1

    def _scrub(self, text: str) -> str:
        for secret in self.endpoint.secrets():
            text = text.replace(secret, "***")
        return text


def _json(response: httpx.Response, where: str) -> Any:
    """The decoded JSON answer (None for an empty one)."""
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError as e:
        raise _Fatal(f"{where} answered with something that is not JSON: {response.text[:200]!r}") from e


def _detail(response: httpx.Response) -> str:
    """The server's error message, short."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(error, dict):
            error = error.get("message", error)
        return str(error)[:300]
    return str(body)[:300]


def _run(coro: Any) -> Any:
    """Run `coro` to completion from synchronous code, also where an event loop already runs."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
