"""Graceful shutdown: on SIGTERM `dspark serve` refuses new requests, lets those in flight finish
within --shutdown-timeout, ends the rest with an error event naming the shutdown, and exits 0."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import threading
import time

import openai
import pytest

from test_data_parallel_server import running_requests
from tiny_server import gated, launched, serve

GRACE_S = 2.0

# `dspark serve` with every engine step slowed down, so that a long request reliably outlives the
# grace period on any machine (the tiny model decodes a thousand tokens a second unthrottled)
SLOW_SERVE = ("import time\n"
              "from dspark.engine.engine import Engine\n"
              "step = Engine.step\n"
              "Engine.step = lambda self: (time.sleep(0.02), step(self))[1]\n"
              "from dspark.cli import main\n"
              "main()\n")


def connect(url: str) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)


def send(conn: http.client.HTTPConnection, method: str, path: str,
         body: dict | None = None) -> http.client.HTTPResponse:
    """One request on `conn` (kept alive between calls); the response once its headers came."""
    conn.request(method, path, None if body is None else json.dumps(body),
                 {"Content-Type": "application/json"})
    return conn.getresponse()


def sse_events(response: http.client.HTTPResponse) -> list:
    """The `data:` payloads of an SSE body, JSON decoded ([DONE] kept as the string)."""
    events = []
    for line in response:
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip().decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def refused(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None = None) -> bool:
    """True when the request could not get through, or was answered 503 "server_shutting_down"."""
    try:
        response = send(conn, method, path, body)
    except (OSError, http.client.HTTPException):          # refused, or the connection was closed
        return True
    return response.status == 503 and json.loads(response.read())["error"]["code"] == "server_shutting_down"


@pytest.fixture
def slow_server(target_dir):
    with launched(SLOW_SERVE, "--model", target_dir, "--no-drafter", "--dtype", "float32",
                  "--graph", "eager", "--threads", "1", "--max-model-len", "512",
                  "--shutdown-timeout", str(GRACE_S)) as served:
        yield served


def wait_running(url: str, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while running_requests(url) < count:
        assert time.monotonic() < deadline, f"{count} requests never ran at once"
        time.sleep(0.01)


@pytest.mark.slow
def test_sigterm_drains_then_exits_zero(slow_server):
    proc, url = slow_server
    body = dict(model="x", prompt="w1 w2", max_tokens=480, ignore_eos=True, stream=True)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    long_events, short = [], []

    def long_request():
        long_events.extend(sse_events(send(connect(url), "POST", "/v1/completions", dict(body, model=model))))

    def short_request():
        short.append(client.completions.create(model=model, prompt="w3", max_tokens=40,
                                               extra_body={"ignore_eos": True}))

    kept_alive = connect(url)
    assert send(kept_alive, "GET", "/v1/models").read()
    threads = [threading.Thread(target=long_request)]
    threads[0].start()
    wait_running(url, 1)
    threads.append(threading.Thread(target=short_request))
    threads[1].start()
    wait_running(url, 2)
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.3)
    assert refused(kept_alive, "POST", "/v1/completions", dict(model=model, prompt="w1"))
    assert refused(connect(url), "GET", "/health")
    for t in threads:
        t.join(GRACE_S + 10)

    assert short and short[0].usage.completion_tokens == 40           # finished within the grace
    assert long_events[-1] == "[DONE]"
    error = long_events[-2]["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"], error
    assert any(e.get("choices") for e in long_events[:-2])              # it had been decoding
    assert proc.wait(timeout=GRACE_S + 8) == 0
    assert time.monotonic() - signalled < GRACE_S + 5
    log = proc.stdout.read()
    assert "ending 1 request(s) still running" in log, log


def test_a_draining_server_refuses_new_work_and_ends_what_is_left(target_dir):
    """The drain itself, in-process: /health and new requests answer 503 at once, and a request
    held in the engine ends with the shutdown error event after the grace period."""
    with serve(target_dir) as served, gated(served.state.engine) as gate:
        url = served.url
        body = dict(model="tiny", prompt="w1 w2", max_tokens=8, stream=True)
        held = send(connect(url), "POST", "/v1/completions", body)
        async_engine = served.state.async_engine
        drained = asyncio.run_coroutine_threadsafe(async_engine.drain(0.5), async_engine._loop)
        conn = connect(url)
        for method, path, payload in [("GET", "/health", None),
                                      ("POST", "/v1/completions", dict(body, stream=False))]:
            response = send(conn, method, path, payload)
            assert response.status == 503
            assert json.loads(response.read())["error"]["code"] == "server_shutting_down"
        events = sse_events(held)
        drained.result(10)
        gate.set()
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "server_shutting_down", events
        served.wait_idle()
        assert not served.state.engine.has_unfinished                   # aborted in the engine
