"""Penalties, logit_bias, min_tokens and include_stop_str_in_output over HTTP: accepted on both
endpoints and applied exactly as the offline API applies the same SamplingParams (with and
without a drafter); a bad value is a 400 naming its field."""

from __future__ import annotations


import pytest

from dspark import SamplingParams
from tiny_server import post, served_and_offline

PROMPT = "w1 w2 w3 w9 w4"
CHAT = [{"role": "user", "content": "w5 w6 w7"}]
FIELDS = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
              logit_bias={"7": 2.5, "12": -4.0}, min_tokens=4)


@pytest.fixture(scope="module", params=["plain", "dspark"])
def setup(request, target_dir, drafter_dir):
    yield from served_and_offline(target_dir, drafter_dir if request.param == "dspark" else None)


def params(**fields) -> SamplingParams:
    """The SamplingParams the server should build from these request fields."""
    bias = {int(k): v for k, v in fields.pop("logit_bias", {}).items()}
    return SamplingParams(temperature=0, logit_bias=bias, **fields)


def test_completion_applies_the_fields_as_offline(setup):
    served, llm = setup
    body = dict(prompt=PROMPT, max_tokens=12, temperature=0, **FIELDS)
    status, reply = post(served, "/v1/completions", body)
    assert status == 200, reply
    want = llm.generate([PROMPT], params(max_tokens=12, **FIELDS))[0]
    assert reply["choices"][0]["text"] == want.text
    assert reply["usage"]["completion_tokens"] == len(want.token_ids)
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0]
    assert want.token_ids != free.token_ids                      # the fields changed the answer


def test_chat_applies_the_fields_as_offline(setup):
    served, llm = setup
    body = dict(messages=CHAT, max_tokens=10, temperature=0, **FIELDS)
    status, reply = post(served, "/v1/chat/completions", body)
    assert status == 200, reply
    want = llm.chat(CHAT, params(max_tokens=10, **FIELDS))
    assert reply["choices"][0]["message"]["content"] == want.text


def test_min_tokens_over_http(setup):
    """`</s>` (the EOS) forced by a bias, yet held back for min_tokens tokens."""
    served, llm = setup
    eos = str(llm.tokenizer.encode("</s>", add_special_tokens=False)[0])
    body = dict(prompt=PROMPT, max_tokens=12, temperature=0, min_tokens=5, logit_bias={eos: 100})
    status, reply = post(served, "/v1/completions", body)
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] == 6 and reply["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(setup, stream):
    served, llm = setup
    full = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].text
    stop = full.split()[2]
    at = full.find(stop)
    for include, end in ((False, at), (True, at + len(stop))):
        body = dict(prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, stop=stop,
                    include_stop_str_in_output=include, stream=stream)
        status, reply = post(served, "/v1/completions", body)
        assert status == 200, reply
        chunks = reply if stream else [reply]
        text = "".join(ch["text"] for c in chunks for ch in c["choices"])
        assert text == full[:end]
        assert [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1] == "stop"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", dict(repetition_penalty=0), "repetition_penalty"),
    ("/v1/completions", dict(repetition_penalty=-1.5), "repetition_penalty"),
    ("/v1/completions", dict(presence_penalty=2.5), "presence_penalty"),
    ("/v1/completions", dict(frequency_penalty=-3), "frequency_penalty"),
    ("/v1/completions", dict(frequency_penalty="high"), "frequency_penalty"),
    ("/v1/completions", dict(logit_bias={"w7": 1}), "logit_bias"),
    ("/v1/completions", dict(logit_bias={"-3": 1}), "logit_bias"),
    ("/v1/completions", dict(logit_bias={"7": 150}), "logit_bias"),
    ("/v1/completions", dict(logit_bias={"7": "up"}), "logit_bias"),
    ("/v1/completions", dict(logit_bias={"128": 1}), "logit_bias"),          # outside the vocabulary
    ("/v1/completions", dict(min_tokens=-1), "min_tokens"),
    ("/v1/completions", dict(min_tokens=9, max_tokens=3), "min_tokens"),
    ("/v1/completions", dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
    ("/v1/chat/completions", dict(presence_penalty=-2.1), "presence_penalty"),
    ("/v1/chat/completions", dict(logit_bias={"1.5": 2}), "logit_bias"),
    ("/v1/chat/completions", dict(repetition_penalty=float("inf")), "repetition_penalty"),
])
def test_bad_values_name_the_field(setup, path, body, param):
    served, _ = setup
    prompt = dict(prompt=PROMPT) if path == "/v1/completions" else dict(messages=CHAT)
    status, reply = post(served, path, {**prompt, "max_tokens": 4, **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
    assert param in reply["error"]["message"], reply
    assert not served.state.engine.has_unfinished
