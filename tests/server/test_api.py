"""The server through the official `openai` client: outputs equal the offline API's, streaming
equals non-streaming, and the OpenAI response shapes hold; with and without a drafter."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from dspark import LLM, SamplingParams
from tiny_server import engine_kwargs, serve

PROMPTS = ["w1 w2 w3", "w7 w7 w40 w3 w9", "w100 w5"]
CHAT = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module", params=["plain", "dspark"])
def setup(request, target_dir, drafter_dir):
    drafter = drafter_dir if request.param == "dspark" else None
    offline = LLM(target_dir, drafter=drafter, **engine_kwargs())
    with serve(target_dir, drafter) as served:
        client = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
        yield served, client, offline, request.param


def offline_text(offline: LLM, prompt, **kw) -> str:
    return offline.generate([prompt], SamplingParams(**kw))[0].text


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks


def test_models_and_health(setup):
    served, client, _, mode = setup
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.owned_by == "dspark"
    assert card.model_extra["speculative"] == (mode == "dspark")
    health = json.loads(urllib.request.urlopen(f"{served.url}/health").read())
    assert health == {"status": "ok"}


def test_greedy_completion_equals_offline(setup):
    _, client, offline, mode = setup
    for prompt in PROMPTS:
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        choice = got.choices[0]
        assert choice.text == offline_text(offline, prompt, temperature=0, max_tokens=12, ignore_eos=True)
        assert choice.finish_reason == "length"
        assert got.object == "text_completion" and got.id.startswith("cmpl-")
        assert got.usage.completion_tokens == 12
        assert got.usage.prompt_tokens == len(prompt.split())
        assert got.usage.total_tokens == got.usage.prompt_tokens + 12
        stats = got.model_extra["dspark"]
        assert (stats["draft_rounds"] > 0) == (mode == "dspark")
        assert stats["accepted_tokens"] <= stats["verified_tokens"] <= stats["drafted_tokens"]


def test_token_id_and_batched_prompts(setup):
    _, client, offline, _ = setup
    ids = [[5, 6, 7, 8], [9, 10]]
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    want = [offline_text(offline, p, temperature=0, max_tokens=6, ignore_eos=True) for p in ids]
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == want
    assert got.usage.prompt_tokens == 6 and got.usage.completion_tokens == 12
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=6, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [offline_text(offline, p, temperature=0, max_tokens=6, ignore_eos=True)
                     for p in PROMPTS[:2]]


def test_streaming_equals_non_streaming(setup):
    _, client, _, _ = setup
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    text, chunks = stream_text(client.completions.create(stream=True, stream_options={"include_usage": True},
                                                         **kw))
    assert text == whole
    assert len([c for c in chunks if c.choices]) > 1
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_sequences(setup):
    _, client, offline, _ = setup
    full = offline_text(offline, PROMPTS[0], temperature=0, max_tokens=30, ignore_eos=True)
    words = full.split()
    stop = " ".join(words[4:6])          # a two-token stop string: it spans engine steps
    want = offline_text(offline, PROMPTS[0], temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    assert len(want) < len(full)
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    got = client.completions.create(**kw).choices[0]
    assert (got.text, got.finish_reason, got.model_extra["stop_reason"]) == (want, "stop", stop)
    text, chunks = stream_text(client.completions.create(stream=True, **kw))
    assert text == want and chunks[-1].choices[0].finish_reason == "stop"
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                    stop=words[2], extra_body={"ignore_eos": True}).choices[0]
    assert got.text == full[: full.index(words[2])]


def test_max_tokens(setup):
    _, client, _, _ = setup
    for n in (1, 2, 7):
        got = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == n and got.choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(setup):
    _, client, offline, _ = setup
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=1.0, top_k=50, seed=1234,
              extra_body={"ignore_eos": True})
    kw["extra_body"]["top_k"] = kw.pop("top_k")
    first = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == first
    assert first == offline_text(offline, PROMPTS[0], temperature=1.0, top_k=50, seed=1234,
                                 max_tokens=16, ignore_eos=True)
    texts = {client.completions.create(**{**kw, "seed": s}).choices[0].text for s in range(4)}
    assert len(texts) > 1


def test_chat_equals_offline(setup):
    _, client, offline, _ = setup
    want = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)).text
    got = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want
    assert got.usage.completion_tokens == 10
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10
    parts = [{"role": "user", "content": [{"type": "text", "text": "w5 "}, {"type": "text", "text": "w6"}]}]
    plain = [{"role": "user", "content": "w5 w6"}]
    a = client.chat.completions.create(model="tiny", messages=parts, max_tokens=5, temperature=0)
    b = client.chat.completions.create(model="tiny", messages=plain, max_tokens=5, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_tokenize(setup):
    served, _, offline, _ = setup
    body = json.dumps({"model": "tiny", "prompt": "w1 w2 w3"}).encode()
    req = urllib.request.Request(f"{served.url}/tokenize", data=body,
                                 headers={"Content-Type": "application/json"})
    got = json.loads(urllib.request.urlopen(req).read())
    assert got == {"tokens": offline.tokenizer.encode("w1 w2 w3"), "count": 3, "max_model_len": 128}


def test_metrics_count_requests_and_tokens(setup):
    served, client, _, mode = setup
    before = served.metrics()
    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=9, temperature=0,
                              extra_body={"ignore_eos": True})
    after = served.wait_idle()
    key = ("dspark_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert after[key] == before.get(key, 0) + 1
    tokens = ("dspark_generation_tokens_total", ())
    assert after[tokens] - before[tokens] == 9
    assert after[("dspark_time_to_first_token_seconds_count", ())] > 0
    drafted = after[("dspark_spec_drafted_tokens_total", ())]
    assert (drafted > 0) == (mode == "dspark")
    runner = {labels[0][1]: value for (name, labels), value in after.items()
              if name == "dspark_runner_steps_total"}
    assert runner["target_graph_steps"] >= 2             # the prefill and at least one more step
    assert (runner.get("draft_graph_steps", 0) > 0) == (mode == "dspark")
    assert after[("dspark_kv_cache_free_blocks", ())] == after[("dspark_kv_cache_blocks", ())]
