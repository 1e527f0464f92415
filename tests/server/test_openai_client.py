"""The official `openai` client against a served fp32 engine, with and without a drafter:
log-probabilities and echo round-trip through its types; each greedy token's log-probability is
the largest of its top_logprobs; prompt log-probabilities (echo, max_tokens 0, as
lm-evaluation-harness asks) equal transformers' log-softmax of the same model within 1e-4."""

from __future__ import annotations

import pytest
import torch

from dspark.tokenizer import Tokenizer
from tiny_server import serve

openai = pytest.importorskip("openai", reason="the openai client is a test dependency")
transformers = pytest.importorskip("transformers")

PROMPT = "w1 w2 w3 w9 w4 w7 w7 w2"


@pytest.fixture(scope="module", params=["plain", "dspark"])
def client(request, target_dir, drafter_dir):
    with serve(target_dir, drafter_dir if request.param == "dspark" else None) as served:
        yield openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(target_dir):
    """(tokenizer, token ids of PROMPT, [len, V] transformers' log-softmax; row p predicts token p + 1)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(target_dir)
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return tokenizer, ids, logprobs


def test_echo_prompt_logprobs_equal_transformers(client, reference):
    tokenizer, ids, ref = reference
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True,
                                      logprobs=2, temperature=0)
    choice = reply.choices[0]
    assert choice.text == PROMPT and reply.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == PROMPT.split()
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        top = ref[p - 1].topk(2)
        for value, token in zip(top.values.tolist(), top.indices.tolist()):
            word = tokenizer.decode([token], skip_special_tokens=False)
            assert lp.top_logprobs[p][word] == pytest.approx(value, abs=1e-4)


def test_greedy_completion_token_is_its_top_logprob(client):
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                      logprobs=3, extra_body={"ignore_eos": True})
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.tokens == reply.choices[0].text.split()          # a word-level vocabulary
    for got, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert got <= 0 and got == pytest.approx(max(top.values()), abs=1e-6)


def test_greedy_chat_token_is_its_top_logprob(client):
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w5 w6 w7"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    assert "".join(entry.token for entry in content).strip() != ""
    for entry in content:
        assert 4 <= len(entry.top_logprobs) <= 5
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-6)
        assert entry.token == max(entry.top_logprobs, key=lambda t: t.logprob).token


def test_echo_with_generation_continues_the_prompt(client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                       echo=True, logprobs=0, extra_body={"ignore_eos": True})
    choice = echoed.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    assert len(choice.logprobs.tokens) == len(PROMPT.split()) + 4


def test_a_refused_value_is_a_client_error(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, logprobs=50)
    assert "logprobs" in str(info.value)
