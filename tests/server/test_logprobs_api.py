"""Log-probabilities and echo over HTTP: the legacy completions form (tokens, token_logprobs,
top_logprobs, text_offset), echo with max_tokens 0 (the prompt's log-probs alone, as
lm-evaluation-harness asks), the chat form, streaming, and the 400s for bad values. Values equal
the offline API's; with and without a drafter."""

from __future__ import annotations

import math

import pytest

from dspark import LLM, SamplingParams
from tiny_server import post, served_and_offline

PROMPT = "w1 w2 w3 w9 w4"
CHAT = [{"role": "user", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module", params=["plain", "dspark"])
def setup(request, target_dir, drafter_dir):
    yield from served_and_offline(target_dir, drafter_dir if request.param == "dspark" else None)


def offline(llm: LLM, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0]


def test_completion_logprobs_equal_offline(setup):
    served, llm = setup
    status, reply = post(served, "/v1/completions", dict(prompt=PROMPT, max_tokens=8, temperature=0,
                                                          logprobs=3, ignore_eos=True))
    assert status == 200, reply
    choice = reply["choices"][0]
    want = offline(llm, PROMPT, temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    tok = llm.tokenizer
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]
    for got, token, entry, top in zip(lp["token_logprobs"], want.token_ids, want.logprobs, lp["top_logprobs"]):
        assert got == pytest.approx(entry[token], abs=1e-6)
        assert 3 <= len(top) <= 4 and got == pytest.approx(max(top.values()), abs=1e-6)   # greedy
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets


def test_echo_with_max_tokens_zero_scores_the_prompt(setup):
    served, llm = setup
    status, reply = post(served, "/v1/completions", dict(prompt=PROMPT, max_tokens=0, echo=True,
                                                          logprobs=1, temperature=0))
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["text"] == PROMPT
    assert reply["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    n = len(PROMPT.split())
    assert lp["tokens"] == PROMPT.split()
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = offline(llm, PROMPT, max_tokens=1, prompt_logprobs=1).prompt_logprobs
    ids = llm.tokenizer.encode(PROMPT)
    for i in range(1, n):
        assert lp["token_logprobs"][i] == pytest.approx(want[i][ids[i]], abs=1e-6)
        assert len(lp["top_logprobs"][i]) in (1, 2)
        assert all(v <= 0 for v in lp["top_logprobs"][i].values())
    total = sum(lp["token_logprobs"][1:])
    assert math.isfinite(total) and total < 0


def test_echo_with_generation(setup):
    served, _ = setup
    body = dict(prompt=PROMPT, max_tokens=4, echo=True, logprobs=0, temperature=0, ignore_eos=True)
    status, reply = post(served, "/v1/completions", body)
    assert status == 200, reply
    choice = reply["choices"][0]
    _, plain = post(served, "/v1/completions", dict(prompt=PROMPT, max_tokens=4, temperature=0, ignore_eos=True))
    assert choice["text"] == PROMPT + plain["choices"][0]["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT.split()) + 4
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])       # logprobs 0: the chosen token only


def test_streamed_logprobs_equal_whole(setup):
    served, _ = setup
    body = dict(prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2, echo=True, ignore_eos=True)
    _, whole = post(served, "/v1/completions", body)
    status, chunks = post(served, "/v1/completions", {**body, "stream": True})
    assert status == 200
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            text += choice["text"]
            for key in joined:
                joined[key] += choice.get("logprobs", {}).get(key, [])
    assert text == whole["choices"][0]["text"]
    want = whole["choices"][0]["logprobs"]
    assert joined["tokens"] == want["tokens"] and joined["text_offset"] == want["text_offset"]
    assert joined["token_logprobs"][0] is None and want["token_logprobs"][0] is None   # echo: first prompt token
    assert joined["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-5)  # rounding: see below
    for got, top in zip(joined["top_logprobs"][1:], want["top_logprobs"][1:]):
        assert got.keys() == top.keys() and list(got.values()) == pytest.approx(list(top.values()), abs=1e-5)


def test_streamed_prompt_only(setup):
    served, _ = setup
    body = dict(prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, stream=True,
                stream_options={"include_usage": True})
    status, chunks = post(served, "/v1/completions", body)
    assert status == 200
    choices = [ch for c in chunks for ch in c["choices"]]
    assert "".join(ch["text"] for ch in choices) == PROMPT
    assert [t for ch in choices for t in ch["logprobs"]["tokens"]] == PROMPT.split()
    assert choices[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def test_chat_logprobs_shape(setup):
    served, _ = setup
    body = dict(messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, ignore_eos=True)
    status, reply = post(served, "/v1/chat/completions", body)
    assert status == 200, reply
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] == 6
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode())
        assert len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
        assert item["logprob"] == pytest.approx(item["top_logprobs"][0]["logprob"], abs=1e-6)  # greedy
        assert set(item["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    status, chunks = post(served, "/v1/chat/completions", {**body, "stream": True})
    streamed = [i for c in chunks for ch in c["choices"] for i in (ch.get("logprobs") or {}).get("content", [])]
    # The policy may draft differently in the second request, and a verify pass over more rows
    # rounds differently in fp32: the tokens match exactly, the logprobs to rounding.
    assert [i["token"] for i in streamed] == [i["token"] for i in content]
    for got, want in zip(streamed, content):
        assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-5)
        assert [t["token"] for t in got["top_logprobs"]] == [t["token"] for t in want["top_logprobs"]]
        for g, w in zip(got["top_logprobs"], want["top_logprobs"]):
            assert g["logprob"] == pytest.approx(w["logprob"], abs=1e-5)
    _, plain = post(served, "/v1/chat/completions", dict(messages=CHAT, max_tokens=2))
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", dict(prompt=PROMPT, logprobs=-1), "logprobs"),
    ("/v1/completions", dict(prompt=PROMPT, logprobs=21), "logprobs"),
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=0), "max_tokens"),
    ("/v1/chat/completions", dict(messages=CHAT, logprobs=True, top_logprobs=50), "top_logprobs"),
    ("/v1/chat/completions", dict(messages=CHAT, top_logprobs=3), "top_logprobs"),
    ("/v1/chat/completions", dict(messages=CHAT, logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("/v1/chat/completions", dict(messages=CHAT, echo=True), "echo"),
])
def test_bad_values_name_the_field(setup, path, body, param):
    served, _ = setup
    status, reply = post(served, path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert param in reply["error"]["message"]
