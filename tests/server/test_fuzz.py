"""Property-based fuzzing of the HTTP API, driven by the server's own OpenAPI schema.

Request bodies for each POST endpoint come from its request schema in four kinds: schema-valid
bodies (numbers mixed with extremes, strings of any code points, lone surrogates included),
bodies whose every number is extreme (0, -1, 2**63, 2**64, 1e308, ...), schema-valid bodies with
one field replaced by arbitrary JSON or a required field dropped, and bodies where any field may
have the wrong type; unknown fields are mixed into all of them. Bodies a real client would send
(most of them run, some streamed) and arbitrary JSON are mixed in too. No answer may be a 5xx,
nor may a stream carry an error event or end without `[DONE]`; afterwards the server is healthy
and every KV block is free.

Deterministic by default (the same cases every run); `DSPARK_FUZZ_SEED=<int>` draws other cases
and `DSPARK_FUZZ_EXAMPLES=<n>` sets the cases per endpoint, for longer hunts."""

from __future__ import annotations

import http.client
import json
import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tiny_server import serve

pytestmark = pytest.mark.slow

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize")
EXAMPLES = int(os.environ.get("DSPARK_FUZZ_EXAMPLES", "300"))       # per endpoint
SEED = os.environ.get("DSPARK_FUZZ_SEED")
TALLY: Counter = Counter()                       # (endpoint, status) over the whole module
KINDS: Counter = Counter()                       # (kind of body, status)

EXTREME_INTS = [0, -1, 1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -(2 ** 63), -(2 ** 63) - 1, 10 ** 30]
EXTREME_FLOATS = [0.0, -0.0, 5e-324, 1e-300, 1e308, -1e308, 1.7976931348623157e308]
INTS = st.one_of(st.integers(-3, 40), st.sampled_from(EXTREME_INTS + [127, 128, 129]))
FLOATS = st.one_of(st.floats(-3, 3, allow_nan=False), st.sampled_from(EXTREME_FLOATS + [1e-6, 1.0, 2.0]))
WORDS = st.lists(st.sampled_from(["w1", "w2", "w17", "user", ":", "<s>", "</s>", "<|end|>", "é", ""]),
                 max_size=6).map(" ".join)
# any code point, lone surrogates too: JSON may escape them ("\ud800") and Python decodes them
ODD_TEXT = ["\ud800", "w1 \udfff", "\x00", "w1\u2028w2", "\U0001f642", "   ", "\u0301", "w1" * 40]
TEXT = st.one_of(WORDS, st.text(st.characters(exclude_categories=()), max_size=12), st.sampled_from(ODD_TEXT))
JSON_SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
ANY_JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)), max_leaves=6)
UNKNOWN = st.dictionaries(st.sampled_from(["frobnicate", "zz", "metadata", "x-extra", ""]), ANY_JSON,
                          max_size=2)
FIELD_VALUES = {"model": st.sampled_from(["tiny", "tiny", "tiny", "tiny", "other", "", "x\udc80"]),
                "role": st.sampled_from(["user", "assistant", "system", "user", "tool", "function",
                                         "x\udc80"])}
MISSING = object()


class SchemaStrategies:
    """JSON schema (as pydantic/FastAPI emit it: $ref, anyOf, object, array, scalars, enum, const)
    -> hypothesis strategies. `mode`: "valid" (what the schema says, numbers often extreme),
    "extreme" (every number extreme, every optional field may appear) or "loose" (any field
    may instead be arbitrary JSON, at any depth)."""

    def __init__(self, openapi: dict, mode: str):
        self.components = openapi["components"]["schemas"]
        self.mode = mode

    def of(self, schema: dict, name: str = "") -> st.SearchStrategy:
        if "$ref" in schema:
            return self.of(self.components[schema["$ref"].rsplit("/", 1)[1]], name)
        if name in FIELD_VALUES:
            return FIELD_VALUES[name]
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
            least = schema.get("minItems", 0)
            return st.lists(self.of(schema.get("items", {}), name), min_size=least, max_size=max(least, 4))
        extreme = self.mode == "extreme"
        numbers = {"integer": st.sampled_from(EXTREME_INTS) if extreme else INTS,
                   "number": st.sampled_from(EXTREME_FLOATS + EXTREME_INTS) if extreme
                   else st.one_of(FLOATS, INTS)}
        scalars = {"boolean": st.booleans(), "string": TEXT, "null": st.none(),
                   "object": st.dictionaries(TEXT, JSON_SCALARS, max_size=3)}
        return {**numbers, **scalars}.get(kind, ANY_JSON)

    def field(self, schema: dict, name: str) -> st.SearchStrategy:
        valid = self.of(schema, name)
        return st.one_of(valid, ANY_JSON) if self.mode == "loose" else valid

    def obj(self, schema: dict) -> st.SearchStrategy:
        props = schema["properties"]
        required = [n for n in props if n in schema.get("required", [])]
        optional = [n for n in props if n not in required]
        # a few optional fields at a time: with all of them, every body would name some field the
        # server refuses (unimplemented, non-neutral) and few would get past validation
        most = len(optional) if self.mode == "extreme" else min(6, len(optional))
        names = st.lists(st.sampled_from(optional), unique=True, max_size=most) if optional else st.just([])
        fields = {n: self.field(props[n], n) for n in props}

        @st.composite
        def body(draw) -> dict:
            out = draw(UNKNOWN)
            for n in required + draw(names):
                out[n] = draw(fields[n])
            return out

        return body()

    def one_wrong(self, schema: dict) -> st.SearchStrategy:
        """A valid body with one top-level field replaced by arbitrary JSON, or dropped."""
        schema = self.components[schema["$ref"].rsplit("/", 1)[1]] if "$ref" in schema else schema

        def spoil(parts) -> dict:
            body, name, value = parts
            body = dict(body)
            if value is MISSING:
                body.pop(name, None)
            else:
                body[name] = value
            return body

        return st.tuples(self.obj(schema), st.sampled_from(sorted(schema["properties"])),
                         st.one_of(ANY_JSON, st.just(MISSING))).map(spoil)


def plausible(path: str) -> st.SearchStrategy:
    """Bodies a real client would send, at the edges of each range: most of them run."""
    sampling = {"temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1e-6, 1e308])),
                "top_p": st.one_of(st.floats(0, 1), st.just(1)),
                "top_k": st.sampled_from([-1, 0, 1, 5, 128, 129]), "min_p": st.floats(0, 1),
                "seed": INTS, "max_tokens": st.one_of(st.integers(1, 80), INTS),
                "stop": st.one_of(WORDS, st.lists(WORDS, max_size=3)), "stream": st.booleans(),
                "stream_options": st.sampled_from([None, {"include_usage": True}, {"include_usage": False}]),
                "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
                "n": st.sampled_from([1, None]), "stop_token_ids": st.lists(st.integers(0, 130), max_size=3),
                "repetition_penalty": st.sampled_from([1.0, None]), "user": TEXT}
    if path == "/tokenize":
        return st.fixed_dictionaries({"prompt": TEXT}, optional={"model": FIELD_VALUES["model"]})
    if path == "/v1/chat/completions":
        content = st.one_of(WORDS, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": WORDS}),
                                            max_size=2))
        message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                         "content": content})
        return st.fixed_dictionaries({"model": st.just("tiny"), "messages": st.lists(message, min_size=1,
                                                                                      max_size=3)},
                                     optional={**sampling, "max_completion_tokens": st.integers(1, 80)})
    prompt = st.one_of(WORDS, st.lists(st.integers(0, 130), min_size=1, max_size=8),
                       st.lists(WORDS, min_size=1, max_size=3),
                       st.lists(st.lists(st.integers(0, 127), min_size=1, max_size=4), min_size=1,
                                max_size=3))
    return st.fixed_dictionaries({"model": st.just("tiny"), "prompt": prompt}, optional=sampling)


def bodies(openapi: dict, path: str) -> st.SearchStrategy:
    """(kind, body) pairs, every kind about equally often."""
    schema = request_schema(openapi, path)
    kinds = {"schema-valid": SchemaStrategies(openapi, "valid").of(schema),
             "extreme-numbers": SchemaStrategies(openapi, "extreme").of(schema),
             "one-field-wrong": SchemaStrategies(openapi, "valid").one_wrong(schema),
             "wrong-types": SchemaStrategies(openapi, "loose").of(schema),
             "plausible": plausible(path), "any-json": ANY_JSON}
    return st.one_of([strategy.map(lambda body, kind=kind: (kind, body)) for kind, strategy in kinds.items()])


@pytest.fixture(scope="module")
def served(target_dir, drafter_dir):
    with serve(target_dir, drafter_dir, max_model_len=64) as served:
        yield served
    print(f"\nfuzz: {sum(TALLY.values())} cases, "
          f"{sum(n for (_, status), n in TALLY.items() if status >= 500)} server errors")
    print("fuzz cases by endpoint and status:", dict(sorted(TALLY.items())))
    print("fuzz cases by kind and status:", dict(sorted(KINDS.items())))


def request_schema(openapi: dict, path: str) -> dict:
    return openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def post(served, path: str, body) -> tuple[int, str, str]:
    """(status, content type, the whole body: a stream is read to its end)."""
    conn = http.client.HTTPConnection("127.0.0.1", served.thread.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return (response.status, response.getheader("content-type", ""),
                response.read().decode(errors="replace"))
    finally:
        conn.close()


def stream_problem(text: str) -> str | None:
    """What is wrong with an SSE body: an error event (the request was accepted, so any error
    after that is the server's), an event that is not JSON, or no `[DONE]` at the end."""
    events = [block[len("data: "):] for block in text.split("\n\n") if block.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "the stream does not end with [DONE]"
    for event in events[:-1]:
        try:
            payload = json.loads(event)
        except ValueError:
            return f"an event is not JSON: {event!r}"
        if "error" in payload:
            return f"an error event: {event}"
    return None


def check_idle_and_healthy(served) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", served.thread.port, timeout=30)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    served.wait_idle()
    blocks = served.state.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


@pytest.mark.parametrize("path", ENDPOINTS)
def test_no_input_makes_the_server_fail(served, path):
    before = sum(n for (p, _), n in TALLY.items() if p == path)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=SEED is None,
              suppress_health_check=list(HealthCheck))
    @given(case=bodies(served.thread.app.openapi(), path))
    def check(case):
        kind, body = case
        status, content_type, text = post(served, path, body)
        TALLY[(path, status)] += 1
        KINDS[(kind, status)] += 1
        assert status < 500, f"{status} for {json.dumps(body)}:\n{text}"
        if content_type.startswith("text/event-stream"):
            problem = stream_problem(text)
            assert problem is None, f"{problem}, for {json.dumps(body)}:\n{text}"

    if SEED is not None:
        check = seed(int(SEED))(check)
    check()
    assert sum(n for (p, _), n in TALLY.items() if p == path) - before >= EXAMPLES
    check_idle_and_healthy(served)


def test_the_server_is_healthy_and_kv_free_afterwards(served):
    check_idle_and_healthy(served)
    status, _, text = post(served, "/v1/completions", {"model": "tiny", "prompt": "w1", "max_tokens": 2})
    assert status == 200, text
