"""The shared HTTP client of the server backends: bounded concurrency, timeouts, retries with
backoff, lost requests named, refused requests raised, credentials kept out of messages.

Runs against a local stub server whose routes misbehave on purpose.
"""

import asyncio
import base64
import threading
import time

import pytest
from http_stub import StubHandler, serve

from parity.backends.http import Endpoint, HttpClient, HttpSettings, RequestsLostError
from parity.core.errors import BackendError, ConfigError
from parity.runtime.processes import free_loopback_port

FAST = dict(backoff_s=0.01)


class Stub(StubHandler):
    """Routes: /ok echoes, /flaky answers 503 `fail` times per id, /slow sleeps, /bad is 400 (quoting
    the Authorization header, to check scrubbing), /boom is 500, /text is not JSON."""

    def do_POST(self):
        state = self.server.state
        body = self.read_json()
        with state["lock"]:
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            state["attempts"][body.get("id")] = state["attempts"].get(body.get("id"), 0) + 1
            attempt = state["attempts"][body.get("id")]
        try:
            time.sleep(body.get("sleep", 0))
            reply = self._answer(body, attempt)
        finally:
            # out of flight before the reply is written: once the client has read it, it may send
            # the next request, which must not find this one still counted
            with state["lock"]:
                state["in_flight"] -= 1
        status, obj, raw = reply
        self.reply(raw if raw is not None else obj, status)

    do_GET = do_POST

    def _answer(self, body, attempt):
        """(status, JSON object, raw bytes or None) of the route."""
        if self.path == "/flaky" and attempt <= body["fail"]:
            return 503, {"error": {"message": "server busy"}}, None
        if self.path == "/bad":
            auth = self.headers.get("Authorization")
            return 400, {"error": {"message": f"bad prompt ({auth})"}}, None
        if self.path == "/boom":
            return 500, {"detail": "engine core died"}, None
        if self.path == "/text":
            return 200, None, b"<html>not json</html>"
        return 200, {"echo": body, "auth": self.headers.get("Authorization")}, None



@pytest.fixture
def stub():
    httpd = serve(Stub)
    httpd.state = {"lock": threading.Lock(), "in_flight": 0, "max_in_flight": 0, "attempts": {}}
    yield httpd
    httpd.shutdown()


def client(httpd, **settings):
    return HttpClient(Endpoint.parse(f"http://127.0.0.1:{httpd.server_address[1]}"),
                      HttpSettings(**{**FAST, **settings}))


def test_answers_in_order_with_bounded_concurrency(stub):
    bodies = [{"id": i, "sleep": 0.1} for i in range(16)]
    answers = client(stub, concurrency=4).post_many("/ok", bodies, [f"r{i}" for i in range(16)])
    assert [a["echo"]["id"] for a in answers] == list(range(16))
    assert stub.state["max_in_flight"] == 4


def test_default_concurrency_is_64():
    assert HttpSettings().concurrency == 64


def test_503_is_retried_with_backoff(stub):
    assert client(stub, retries=3).post("/flaky", {"id": "a", "fail": 2})["echo"]["id"] == "a"
    assert stub.state["attempts"]["a"] == 3
    with pytest.raises(BackendError, match="HTTP 503: server busy; gave up after 1 retries"):
        client(stub, retries=1).post("/flaky", {"id": "b", "fail": 5})
    assert stub.state["attempts"]["b"] == 2


def test_connection_refused_loses_every_request_by_name():
    c = HttpClient(Endpoint.parse(f"http://127.0.0.1:{free_loopback_port()}"),
                   HttpSettings(retries=2, **FAST))
    with pytest.raises(RequestsLostError) as info:
        c.post_many("/ok", [{"id": 1}, {"id": 2}], ["r0/0", "r0/1"])
    err = info.value
    assert [r.label for r in err.lost] == ["r0/0", "r0/1"] and err.completed == 0 and err.total == 2
    assert "2 of 2 requests to http://127.0.0.1" in str(err) and "connection failed" in str(err)
    assert "gave up after 2 retries" in str(err)


def test_a_dead_server_fails_at_once():
    calls = []

    def liveness():
        calls.append(1)
        return "process 123 was killed by SIGKILL"

    c = HttpClient(Endpoint.parse(f"http://127.0.0.1:{free_loopback_port()}"),
                   HttpSettings(retries=5, backoff_s=10.0), liveness=liveness)
    t0 = time.monotonic()
    with pytest.raises(RequestsLostError, match="the server died: process 123 was killed by SIGKILL"):
        c.post_many("/ok", [{"id": i} for i in range(5)], [f"r{i}" for i in range(5)])
    assert time.monotonic() - t0 < 5  # no 10 s backoff: dead means dead


def test_request_timeout_loses_the_request(stub):
    with pytest.raises(RequestsLostError, match=r"slow \(no answer within the request timeout of 0.3 s\)"):
        client(stub, request_timeout_s=0.3).post_many("/ok", [{"id": 1}, {"id": 2, "sleep": 2}],
                                                      ["fast", "slow"])


def test_run_timeout_names_the_unfinished_requests(stub):
    bodies = [{"id": i, "sleep": 0.4} for i in range(6)]
    labels = [f"r{i}" for i in range(6)]
    with pytest.raises(RequestsLostError) as info:
        client(stub, concurrency=1, run_timeout_s=1.0).post_many("/ok", bodies, labels)
    err = info.value
    assert 1 <= err.completed <= 3
    assert [r.label for r in err.lost] == labels[err.completed:]
    assert all("run timeout of 1 s" in r.reason for r in err.lost)


def test_a_refused_request_is_an_error_not_a_loss(stub):
    t0 = time.monotonic()
    with pytest.raises(BackendError, match=r"refused request r1: HTTP 400: bad prompt") as info:
        client(stub).post_many("/bad", [{"id": 0, "sleep": 3}, {"id": 1}], ["r0", "r1"])
    assert not isinstance(info.value, RequestsLostError)
    assert time.monotonic() - t0 < 2.5  # raised without waiting for the slow request


def test_server_errors_are_lost_not_retried(stub):
    with pytest.raises(RequestsLostError, match=r"r0 \(HTTP 500: engine core died\)"):
        client(stub).post_many("/boom", [{"id": "x"}], ["r0"])
    assert stub.state["attempts"]["x"] == 1


def test_an_answer_that_is_not_json_is_an_error(stub):
    with pytest.raises(BackendError, match="not JSON"):
        client(stub).post("/text", {"id": 1})


def test_works_inside_a_running_event_loop(stub):
    async def main():
        return client(stub).post_many("/ok", [{"id": 1}], ["r"])

    assert asyncio.run(main())[0]["echo"]["id"] == 1


@pytest.mark.parametrize("url, message", [
    ("ftp://127.0.0.1:8000", "scheme must be one of"),
    ("127.0.0.1:8000", "scheme must be one of"),
    ("http://", "names no host"),
    ("http://127.0.0.1:99999", "out of range"),
    ("", "must be a server URL"),
])
def test_url_is_checked(url, message):
    with pytest.raises(ConfigError, match=message):
        Endpoint.parse(url)


def test_api_key_comes_from_the_named_variable_and_never_shows(stub, monkeypatch):
    monkeypatch.setenv("PARITY_TEST_KEY", "sk-secret-123")
    endpoint = Endpoint.parse(f"http://127.0.0.1:{stub.server_address[1]}/", api_key_env="PARITY_TEST_KEY")
    assert "sk-secret" not in repr(endpoint) and endpoint.public == f"http://127.0.0.1:{stub.server_address[1]}"
    c = HttpClient(endpoint, HttpSettings(**FAST))
    assert c.post("/ok", {"id": 1})["auth"] == "Bearer sk-secret-123"
    with pytest.raises(BackendError) as info:
        c.post("/bad", {"id": 2})
    assert "Bearer ***" in str(info.value) and "sk-secret" not in str(info.value)
    monkeypatch.delenv("PARITY_TEST_KEY")
    with pytest.raises(ConfigError, match=r"PARITY_TEST_KEY.*not set"):
        Endpoint.parse("http://127.0.0.1:1", api_key_env="PARITY_TEST_KEY")


def test_credentials_in_the_url_are_used_but_not_recorded(stub):
    port = stub.server_address[1]
    endpoint = Endpoint.parse(f"http://alice:pa%40ss@127.0.0.1:{port}/v1")  # a query is refused (item 10)
    assert endpoint.public == f"http://127.0.0.1:{port}/v1"
    auth = HttpClient(endpoint, HttpSettings(**FAST)).post("/ok", {"id": 1})["auth"]
    assert base64.b64decode(auth.removeprefix("Basic ")) == b"alice:pa@ss"


@pytest.mark.parametrize("field, value", [("concurrency", 0), ("concurrency", True), ("retries", -1),
                                          ("request_timeout_s", 0), ("run_timeout_s", float("nan")),
                                          ("backoff_s", -1)])
def test_settings_are_validated(field, value):
    with pytest.raises(ConfigError, match=f"option {field} must be"):
        HttpSettings(**{field: value})
