"""Every bad input gets its documented status and an OpenAI error body naming the problem, and
the server keeps serving afterwards: a full queue answers 429, a failing engine step 500."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tiny_server import gated, serve

LONG = " ".join(["w1"] * 200)           # over max_model_len=128

COMPLETION_CASES = [
    # (request overrides, status, param, message fragment)
    (dict(temperature=-1.0), 400, "temperature", "temperature must be a finite number >= 0"),
    (dict(temperature="hot"), 400, "temperature", "valid number"),
    (dict(top_p=0.0), 400, "top_p", "top_p must be in (0, 1]"),
    (dict(extra_body={"top_k": -5}), 400, "top_k", "top_k must be"),
    (dict(extra_body={"min_p": 2.0}), 400, "min_p", "min_p must be in [0, 1]"),
    (dict(max_tokens=0), 400, "max_tokens", "max_tokens must be an integer >= 1"),
    (dict(max_tokens=2.5), 400, "max_tokens", "valid integer"),
    (dict(seed="x"), 400, "seed", "valid integer"),
    (dict(stop=[""]), 400, "stop", "stop strings must be non-empty"),
    (dict(extra_body={"stop_token_ids": [-1]}), 400, "stop_token_ids", "non-negative"),
    (dict(prompt=5), 400, "prompt", "wrong type"),
    (dict(prompt=[]), 400, "prompt", "must not be empty"),
    (dict(prompt=[1, 99999]), 400, "prompt", "token ids must be in [0, 128)"),
    (dict(prompt=LONG), 400, "prompt", "more than the context allows"),
    (dict(n=0), 400, "n", "n must be an integer in [1, "),
    (dict(n=2, temperature=0), 400, "n", "n must be 1 when using greedy sampling"),
    (dict(logprobs=-1), 400, "logprobs", "logprobs must be null or an integer in [0, 20]"),
    (dict(echo=True, max_tokens=0, logprobs=21), 400, "logprobs", "[0, 20]"),
    (dict(best_of=3), 400, "best_of", "not supported"),
    (dict(presence_penalty=2.5), 400, "presence_penalty", "presence_penalty must be in [-2, 2]"),
    (dict(stream_options={"include_usage": True}), 400, "stream_options", "only allowed when"),
    (dict(model="gpt-4"), 404, "model", "the model 'gpt-4' does not exist"),
]

CHAT_CASES = [
    (dict(messages=[]), 400, "messages", "at least 1 item"),
    (dict(messages=[{"role": "tool", "content": "w1"}]), 400, "messages", "unknown role tool"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages", "messages"),
    (dict(messages=[{"content": "w1"}]), 400, "messages", "Field required"),
    (dict(max_completion_tokens=0), 400, "max_completion_tokens", "max_completion_tokens must be"),
    (dict(messages=[{"role": "user", "content": LONG}]), 400, "messages", "more than the context"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "not supported"),
    (dict(top_logprobs=50, logprobs=True), 400, "top_logprobs", "top_logprobs must be"),
    (dict(extra_body={"echo": True}), 400, "echo", "not supported"),
    (dict(model="nope"), 404, "model", "does not exist"),
]


@pytest.fixture(scope="module")
def served(target_dir):
    with serve(target_dir, max_queue=2) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)


def good_completion(client) -> str:
    got = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=4, temperature=0)
    return got.choices[0].text


def raw(served, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"{served.url}{path}", data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def check_error(exc: openai.APIStatusError, status: int, param: str, fragment: str) -> None:
    assert exc.status_code == status
    error = exc.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert fragment in error["message"], error


@pytest.mark.parametrize("overrides,status,param,fragment", COMPLETION_CASES)
def test_bad_completion(client, overrides, status, param, fragment):
    kw = dict(model="tiny", prompt="w1 w2", max_tokens=4)
    kw.update(overrides)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**kw)
    check_error(info.value, status, param, fragment)
    assert good_completion(client)


@pytest.mark.parametrize("overrides,status,param,fragment", CHAT_CASES)
def test_bad_chat(client, overrides, status, param, fragment):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "w1"}], max_tokens=4)
    kw.update(overrides)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**kw)
    check_error(info.value, status, param, fragment)


def test_bad_streaming_request_fails_before_streaming(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=LONG, max_tokens=4, stream=True)
    check_error(info.value, 400, "prompt", "more than the context")


def test_malformed_bodies_and_routes(served):
    status, body = raw(served, "POST", "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body = raw(served, "POST", "/v1/completions", b'{"model": "tiny"}')
    assert status == 400 and body["error"]["param"] == "prompt"
    assert "Field required" in body["error"]["message"]
    status, body = raw(served, "POST", "/v1/completions", b'["a list"]')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = raw(served, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = raw(served, "GET", "/v1/completions")
    assert status == 405 and "error" in body


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition()


def test_queue_full_answers_429(served, client):
    with gated(served.state.engine) as gate, ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(good_completion, client) for _ in range(2)]
        wait_for(lambda: served.state.async_engine.num_waiting == 2)
        with pytest.raises(openai.RateLimitError) as info:
            good_completion(client)
        check_error(info.value, 429, None, "max_queue=2")
        gate.set()
        assert all(f.result(timeout=30) for f in pending)
    values = served.wait_idle()
    assert values[("dspark_http_requests_total", (("endpoint", "/v1/completions"), ("status", "429")))] == 1
    assert good_completion(client)


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_before_any_output_aborts(served, client, stream):
    """Nothing is sent to a client whose request has not produced output yet; its leaving must
    still be noticed, and the request aborted, not run to its (long) end."""
    aborted = ("dspark_requests_aborted_total", ())
    before = served.metrics()[aborted]
    body = json.dumps({"model": "tiny", "prompt": "w1 w2", "max_tokens": 100, "ignore_eos": True,
                       "stream": stream})
    with gated(served.state.engine):
        conn = http.client.HTTPConnection("127.0.0.1", served.thread.port, timeout=10)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        wait_for(lambda: served.state.engine.has_unfinished)
        if stream:
            assert conn.getresponse().status == 200        # headers come at once; no data yet
        conn.sock.close()
        conn.close()
        time.sleep(0.2)
    wait_for(lambda: served.metrics()[aborted] == before + 1)
    served.wait_idle()
    engine = served.state.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert good_completion(client)


def test_failing_step_answers_500_and_recovers(served, client):
    engine = served.state.engine
    real_step = engine.step

    def broken_step():
        raise RuntimeError("simulated device fault")

    engine.step = broken_step
    try:
        with pytest.raises(openai.InternalServerError) as info:
            good_completion(client)
        check_error(info.value, 500, None, "simulated device fault")
        stream = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=4, stream=True)
        with pytest.raises(openai.APIError, match="simulated device fault"):
            list(stream)
    finally:
        engine.step = real_step
    assert good_completion(client)
    served.wait_idle()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
