"""Property-based fuzzing of the HTTP API, driven by the server's own OpenAPI schema: request
bodies generated from each endpoint's schema, with extreme numbers, unknown fields and wrong
types mixed in, never get a 5xx (nor a server error inside a stream); afterwards the server is
healthy and every KV block is free."""

from __future__ import annotations

import http.client
import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny_server import serve

pytestmark = pytest.mark.slow

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize")
EXAMPLES = 300                                   # per endpoint
TALLY: Counter = Counter()                       # (endpoint, status) over the whole module

INTS = st.one_of(st.integers(-3, 40), st.sampled_from(
    [0, -1, 1, 127, 128, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -(2 ** 63), -(2 ** 63) - 1, 10 ** 30]))
FLOATS = st.one_of(st.floats(-3, 3, allow_nan=False), st.sampled_from(
    [0.0, -0.0, 1e-300, 1e-6, 1.0, 2.0, 1e308, -1e308, 5e-324]))
WORDS = st.lists(st.sampled_from(["w1", "w2", "w17", "user", ":", "<s>", "</s>", "<|end|>", "é", ""]),
                 max_size=6).map(" ".join)
TEXT = st.one_of(WORDS, st.text(max_size=12))
JSON_SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
ANY_JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)), max_leaves=6)
FIELD_VALUES = {"model": st.sampled_from(["tiny", "tiny", "tiny", "other", ""]),
                "role": st.sampled_from(["user", "assistant", "system", "tool", "function", "x"]),
                "type": st.sampled_from(["text", "image_url", "json_object", "function"])}


class SchemaStrategies:
    """JSON-schema (as FastAPI emits it) -> hypothesis strategies, with wrong types mixed in."""

    def __init__(self, openapi: dict):
        self.components = openapi["components"]["schemas"]

    def of(self, schema: dict, name: str = "") -> st.SearchStrategy:
        if "$ref" in schema:
            return self.of(self.components[schema["$ref"].rsplit("/", 1)[1]], name)
        if name in FIELD_VALUES:
            return st.one_of(FIELD_VALUES[name], ANY_JSON)
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        options = schema.get("anyOf") or schema.get("oneOf")
        if options:
            return st.one_of([self.of(option, name) for option in options])
        kind = schema.get("type")
        if kind == "object" and "properties" in schema:
            return self.obj(schema)
        if kind == "array":
            return st.lists(self.of(schema.get("items", {}), name),
                            min_size=min(schema.get("minItems", 0), 2), max_size=4)
        return {"integer": INTS, "number": st.one_of(FLOATS, INTS), "boolean": st.booleans(),
                "string": TEXT, "null": st.none(),
                "object": st.dictionaries(TEXT, JSON_SCALARS, max_size=3)}.get(kind, ANY_JSON)

    def obj(self, schema: dict) -> st.SearchStrategy:
        props = schema["properties"]
        required = set(schema.get("required", []))
        field = lambda name: st.one_of(self.of(props[name], name), ANY_JSON) if name not in required \
            else self.of(props[name], name)                                            # noqa: E731
        body = st.fixed_dictionaries({n: self.of(props[n], n) for n in props if n in required},
                                     optional={n: field(n) for n in props if n not in required})
        unknown = st.dictionaries(st.sampled_from(["frobnicate", "zz", "metadata", "x-extra"]),
                                  JSON_SCALARS, max_size=2)
        return st.tuples(body, unknown).map(lambda pair: {**pair[1], **pair[0]})


def plausible(path: str) -> st.SearchStrategy:
    """Bodies a real client would send, at the edges of each range: most of them run."""
    sampling = {"temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1e-6, 1e308])),
                "top_p": st.one_of(st.floats(0, 1), st.just(1)), "top_k": st.sampled_from([-1, 0, 1, 5, 128, 129]),
                "min_p": st.floats(0, 1), "seed": INTS, "max_tokens": st.one_of(st.integers(1, 80), INTS),
                "stop": st.one_of(WORDS, st.lists(WORDS, max_size=3)), "stream": st.booleans(),
                "ignore_eos": st.booleans(), "n": st.sampled_from([1, None]),
                "stop_token_ids": st.lists(st.integers(0, 130), max_size=3),
                "repetition_penalty": st.sampled_from([1.0, None]), "user": TEXT}
    if path == "/tokenize":
        return st.fixed_dictionaries({"prompt": TEXT}, optional={"model": FIELD_VALUES["model"]})
    if path == "/v1/chat/completions":
        message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                         "content": WORDS})
        return st.fixed_dictionaries({"model": st.just("tiny"), "messages": st.lists(message, min_size=1,
                                                                                      max_size=3)},
                                     optional=sampling)
    prompt = st.one_of(WORDS, st.lists(st.integers(0, 130), min_size=1, max_size=8),
                       st.lists(WORDS, min_size=1, max_size=3))
    return st.fixed_dictionaries({"model": st.just("tiny"), "prompt": prompt}, optional=sampling)


@pytest.fixture(scope="module")
def served(target_dir, drafter_dir):
    with serve(target_dir, drafter_dir, max_model_len=64) as served:
        yield served
    print("\nfuzz cases by endpoint and status:", dict(sorted(TALLY.items())),
          "total", sum(TALLY.values()))


def request_schema(openapi: dict, path: str) -> dict:
    return openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def post(served, path: str, body) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", served.thread.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        conn.close()


@pytest.mark.parametrize("path", ENDPOINTS)
def test_no_input_makes_the_server_fail(served, path):
    strategies = SchemaStrategies(served.thread.app.openapi())
    bodies = st.one_of(strategies.of(request_schema(served.thread.app.openapi(), path)), plausible(path),
                       plausible(path), ANY_JSON)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies)
    def check(body):
        status, text = post(served, path, body)
        TALLY[(path, status)] += 1
        assert status < 500, (body, status, text)
        assert '"type": "server_error"' not in text, (body, text)       # nor inside a stream

    check()
    assert sum(n for (p, _), n in TALLY.items() if p == path) >= EXAMPLES


def test_the_server_is_healthy_and_kv_free_afterwards(served):
    assert sum(TALLY.values()) >= EXAMPLES * len(ENDPOINTS)
    conn = http.client.HTTPConnection("127.0.0.1", served.thread.port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    served.wait_idle()
    blocks = served.state.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    assert post(served, "/v1/completions", {"model": "tiny", "prompt": "w1", "max_tokens": 2})[0] == 200
