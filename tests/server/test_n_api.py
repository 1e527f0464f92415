"""`n` on both endpoints: choice i * n + j is completion j of prompt i (seeded seed + j, as vLLM),
streamed chunks carry their choice's index, usage counts each prompt once; bad n is a 400."""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from dspark import LLM, SamplingParams
from dspark.engine.parallel_sampling import child_params
from dspark.server.limits import ServerLimits
from tiny_server import engine_kwargs, serve

PROMPT = "w7 w7 w40 w3 w9 w12 w5 w8 w1"          # 9 tokens: two full blocks of 4 shared
CHAT = [{"role": "user", "content": "w5 w6 w7 w8 w9"}]
SAMPLING = dict(temperature=0.9, seed=11, max_tokens=10)


@pytest.fixture(scope="module", params=["plain", "dspark"])
def setup(request, target_dir, drafter_dir):
    drafter = drafter_dir if request.param == "dspark" else None
    offline = LLM(target_dir, drafter=drafter, **engine_kwargs())
    with serve(target_dir, drafter, limits=ServerLimits(max_choices=8)) as served:
        client = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
        yield served, client, offline


def singles(offline: LLM, prompt, n: int, **kw) -> list[str]:
    """The texts of n single requests with completion j's params (seed + j)."""
    params = SamplingParams(**SAMPLING, ignore_eos=True, n=n, **kw)
    return [offline.generate([prompt], child_params(params, j))[0].text for j in range(n)]


def test_completion_choices(setup):
    served, client, offline = setup
    got = client.completions.create(model="tiny", prompt=PROMPT, n=3, **SAMPLING,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == singles(offline, PROMPT, 3)
    assert got.usage.prompt_tokens == 9                  # the prompt once, not three times
    assert got.usage.completion_tokens == 30 and got.usage.total_tokens == 39
    prompts = [PROMPT, "w100 w5 w6"]
    got = client.completions.create(model="tiny", prompt=prompts, n=2, **SAMPLING,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == singles(offline, prompts[0], 2) + singles(offline, prompts[1], 2)
    assert got.usage.prompt_tokens == 9 + 3 and got.usage.completion_tokens == 40
    served.wait_idle()
    bm = served.state.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_completion_streaming(setup):
    _, client, offline = setup
    stream = client.completions.create(model="tiny", prompt=PROMPT, n=3, stream=True, **SAMPLING,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, finished = ["", "", ""], []
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finished.append(choice.index)
    assert texts == singles(offline, PROMPT, 3)
    assert sorted(finished) == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 9
    assert chunks[-1].usage.completion_tokens == 30


def test_chat_choices_and_streaming(setup):
    _, client, offline = setup
    ids = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True),
                                   add_special_tokens=False)
    want = singles(offline, ids, 2)
    got = client.chat.completions.create(model="tiny", messages=CHAT, n=2, **SAMPLING,
                                         extra_body={"ignore_eos": True})
    assert [(c.index, c.message.content) for c in got.choices] == list(enumerate(want))
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 20
    stream = client.chat.completions.create(model="tiny", messages=CHAT, n=2, stream=True, **SAMPLING,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    texts, roles = ["", ""], []
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.delta.role:
            roles.append(choice.index)
    assert texts == want and sorted(roles) == [0, 1]       # each choice announces its role once
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 20


def post(served, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", served.thread.port, timeout=30)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    status, payload = response.status, json.loads(response.read())
    conn.close()
    return status, payload


BAD = [
    # (body fields, param, message fragment)
    (dict(n=0), "n", "n must be an integer in [1, "),
    (dict(n=-1), "n", "n must be an integer in [1, "),
    (dict(n=2, temperature=0), "n", "n must be 1 when using greedy sampling"),
    (dict(n=9), "n", "more than this server's limit of 8"),
    (dict(n=5, prompt=["w1", "w2"]), "n", "10 choices"),
    (dict(n=2, best_of=3), "best_of", "'best_of' must equal n (2)"),
    (dict(best_of=2), "best_of", "'best_of' must equal n (1)"),
    (dict(n=2, seed=2 ** 63 - 1), "seed", "the last completion's seed"),
]


@pytest.mark.parametrize("fields,param,fragment", BAD)
def test_bad_n_is_a_400_naming_the_field(setup, fields, param, fragment):
    served, _, _ = setup
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 3, "temperature": 1.0, **fields}
    status, reply = post(served, "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert fragment in reply["error"]["message"], reply
    if "prompt" not in fields:
        chat = {"model": "tiny", "messages": CHAT, "max_tokens": 3, "temperature": 1.0, **fields}
        if "best_of" not in fields:                      # a completions-only field
            status, reply = post(served, "/v1/chat/completions", chat)
            assert status == 400 and reply["error"]["param"] == param, reply
    assert not served.state.engine.has_unfinished


def test_best_of_equal_to_n_is_accepted(setup):
    served, _, _ = setup
    status, reply = post(served, "/v1/completions", {"model": "tiny", "prompt": "w1 w2", "max_tokens": 3,
                                                     "temperature": 1.0, "n": 2, "best_of": 2})
    assert status == 200 and len(reply["choices"]) == 2
