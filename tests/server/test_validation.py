"""Every field is checked at the boundary: out-of-range values and fields that would change the
answer but are not implemented get a 400 naming them, neutral values and nulls are accepted,
and the limits (body size, prompts, stop strings) hold. Nothing refused reaches the engine."""

from __future__ import annotations

import http.client
import json
import logging
import select
import socket
import threading
import time
import uuid

import openai
import pytest

from dspark.server.limits import ServerLimits
from tiny_server import gated, serve

LIMITS = ServerLimits(max_request_bytes=32 * 1024, max_prompts=4, max_stop=3, max_stop_chars=8)


@pytest.fixture(scope="module")
def served(target_dir):
    with serve(target_dir, limits=LIMITS) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)


def post(served, path: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", served.thread.port, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    status, payload = response.status, response.read()
    conn.close()
    return status, json.loads(payload) if payload else {}


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "w1 w2", "max_tokens": 3, **fields}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 3, **fields}


REFUSED = [
    # (endpoint body, param, message fragment)
    (completion(temperature=1, top_k=2 ** 63), "top_k", "top_k must be"),
    (completion(temperature=1, top_k=129), "top_k", "at most the vocabulary size (128)"),
    (completion(seed=2 ** 63), "seed", "seed must be an integer in"),
    (completion(seed=-(2 ** 63) - 1), "seed", "seed must be an integer in"),
    (completion(stop_token_ids=[2 ** 64]), "stop_token_ids", "non-negative integers"),
    (completion(repetition_penalty=0), "repetition_penalty", "repetition_penalty must be a finite number > 0"),
    (completion(min_tokens=-1), "min_tokens", "min_tokens must be an integer in"),
    (completion(response_format={"type": "json_object"}), "response_format", "not supported"),
    (completion(guided_json={"type": "object"}), "guided_json", "not supported"),
    (completion(guided_choice=["a", "b"]), "guided_choice", "not supported"),
    (completion(structured_outputs={"regex": "a+"}), "structured_outputs", "not supported"),
    (completion(include_stop_str_in_output=1), "include_stop_str_in_output", "valid boolean"),
    (completion(bad_words=["w1"]), "bad_words", "not supported"),
    (completion(allowed_token_ids=[4, 5]), "allowed_token_ids", "not supported"),
    (completion(truncate_prompt_tokens=2), "truncate_prompt_tokens", "not supported"),
    (completion(use_beam_search=True), "use_beam_search", "not supported"),
    (completion(logit_bias={"five": 10}), "logit_bias", "logit_bias keys must be token ids"),
    (completion(n=True), "n", "valid integer"),
    (completion(stop=["a", "b", "c", "d"]), "stop", "more than this server's limit of 3"),
    (completion(stop="longer than eight"), "stop", "limit of 8"),
    (completion(stop_token_ids=[1, 2, 3, 4]), "stop_token_ids", "limit of 3"),
    (completion(prompt=["w1"] * 5), "prompt", "limit of 4 per request"),
    (chat(tool_choice="required"), "tool_choice", "not supported"),
    (chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", "not supported"),
    (chat(functions=[{"name": "f"}]), "functions", "not supported"),
    (chat(chat_template_kwargs={"enable_thinking": True}), "chat_template_kwargs", "not supported"),
    (chat(continue_final_message=True), "continue_final_message", "not supported"),
    (chat(chat_template="{{ messages }}"), "chat_template", "not supported"),
    (chat(top_logprobs=2), "top_logprobs", "needs 'logprobs': true"),
    (chat(messages=[{"role": "assistant", "content": None,
                     "tool_calls": [{"id": "1", "type": "function",
                                     "function": {"name": "f", "arguments": "{}"}}]}]),
     "messages.0.tool_calls", "not supported"),
    (chat(seed=2 ** 70), "seed", "seed must be an integer in"),
]


@pytest.mark.parametrize("body,param,fragment", REFUSED)
def test_refused_with_the_field_named(served, body, param, fragment):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    before = served.state.engine.scheduler.num_preemptions, served.metrics()
    status, reply = post(served, path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
    assert fragment in reply["error"]["message"], reply
    assert before[0] == served.state.engine.scheduler.num_preemptions
    assert not served.state.engine.has_unfinished              # nothing reached the engine


ACCEPTED = [
    completion(repetition_penalty=1.0, presence_penalty=0, frequency_penalty=0.0, n=1, best_of=1,
               min_tokens=0, logit_bias={}, echo=False, include_stop_str_in_output=False,
               response_format={"type": "text"}, use_beam_search=False, length_penalty=1.0),
    completion(n=None, stream=None, echo=None, logprobs=None, temperature=None, top_p=None,
               seed=None, stop=None, max_tokens=None, ignore_eos=None, user=None, suffix=None),
    completion(temperature=1, top_k=128, seed=2 ** 63 - 1),
    completion(temperature=1, seed=-(2 ** 63)),
    chat(tool_choice="none", tools=[], logprobs=False, n=1, chat_template_kwargs={},
         parallel_tool_calls=True, modalities=["text"]),
    chat(stream=None, add_generation_prompt=None, max_completion_tokens=None, top_logprobs=None),
]


@pytest.mark.parametrize("body", ACCEPTED)
def test_neutral_values_and_nulls_accepted(served, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, reply = post(served, path, body)
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")


def test_unknown_fields_are_logged_once(served, caplog):
    first, second = f"frob_{uuid.uuid4().hex[:8]}", f"zz_{uuid.uuid4().hex[:8]}"   # never seen before
    with caplog.at_level(logging.WARNING, logger="dspark.server.unsupported"):
        for _ in range(3):
            assert post(served, "/v1/completions", completion(**{first: 3, second: [1]}))[0] == 200
    logged = [r.getMessage() for r in caplog.records]
    assert sum(f"'{first}'" in m for m in logged) == 1
    assert sum(f"'{second}'" in m for m in logged) == 1


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", completion(prompt="w1 \ud800"), "prompt"),
    ("/v1/completions", completion(model="x\udc80"), "model"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "\ud800"}]), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "x\udc80", "content": "w1"}]), "messages"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
])
def test_lone_surrogates_are_refused(served, path, body, param):
    """JSON may escape a lone UTF-16 surrogate; no tokenizer or response can encode one."""
    status, reply = post(served, path, body)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert "lone UTF-16 surrogate" in reply["error"]["message"]


def test_body_over_the_limit_is_413(served, client):
    big = completion(prompt="w1 " * 20_000)
    status, reply = post(served, "/v1/completions", big)
    assert status == 413 and "limit of 32768 bytes" in reply["error"]["message"]
    chunked = socket.create_connection(("127.0.0.1", served.thread.port), timeout=30)
    payload = json.dumps(big).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(payload[i:i + 4096]), payload[i:i + 4096])
                      for i in range(0, len(payload), 4096))
    chunked.sendall(head + chunks + b"0\r\n\r\n")
    reply = chunked.recv(4096).decode(errors="replace")
    chunked.close()
    assert reply.startswith("HTTP/1.1 413"), reply
    assert client.completions.create(model="tiny", prompt="w1", max_tokens=2).choices


def test_bad_request_beside_running_ones_harms_none(served, client):
    """The original hole: a top_k past int64 once failed every request in the batch."""
    solo = [client.completions.create(model="tiny", prompt=f"w{i} w3", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for i in range(3)]
    results: list = [None] * 3

    def run(i: int) -> None:
        results[i] = client.completions.create(model="tiny", prompt=f"w{i} w3", max_tokens=12,
                                               temperature=0, extra_body={"ignore_eos": True})

    with gated(served.state.engine) as gate:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while served.state.async_engine.num_waiting < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, reply = post(served, "/v1/completions",
                             completion(temperature=1, top_k=9223372036854775808))
        gate.set()
        for t in threads:
            t.join(30)
    assert status == 400 and reply["error"]["param"] == "top_k"
    assert [r.choices[0].text for r in results] == solo


def test_chat_stream_sends_the_role_with_the_first_token(served):
    """No chunk before the first token: a role chunk ahead of prefill made every TTFT near zero."""
    body = json.dumps(chat(stream=True, max_tokens=4, ignore_eos=True, temperature=0)).encode()
    sock = socket.create_connection(("127.0.0.1", served.thread.port), timeout=30)
    with gated(served.state.engine) as gate:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(4096)
        head, _, early = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert not early and not select.select([sock], [], [], 0.5)[0]   # nothing before a step
        gate.set()
        while b"data: [DONE]" not in received:
            received += sock.recv(4096)
    sock.close()
    lines = [line for line in received.decode().splitlines() if line.startswith("data: {")]
    chunks = [json.loads(line[len("data: "):]) for line in lines]
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and "content" in first
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text.split()) == 4
