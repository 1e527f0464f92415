"""The embedded SmolLM2 through the server equals the offline API (greedy), with and without
the shipped drafter.  One engine serves both sides: offline first, then behind the server."""

from __future__ import annotations

import openai
import pytest

import dspark.config
from dspark import LLM, SamplingParams
from dspark.server import ServerThread, build_app

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]
CHAT = [{"role": "user", "content": "What is 2+2?"}]


@pytest.mark.parametrize("drafter", [None, "auto"])
def test_embedded_model_matches_offline(drafter):
    """"auto" (the default) is the shipped pair: drafter and its STS calibration."""
    llm = LLM(drafter=drafter, max_model_len=512, max_num_seqs=8, graph="eager")
    if drafter == "auto":
        assert llm.engine.drafter is not None and llm.engine.sts is not None
        assert llm.engine.config.spec.drafter == dspark.config.EMBEDDED_DRAFTER_DIR
    greedy = SamplingParams(temperature=0, max_tokens=24)
    want = [o.text for o in llm.generate(PROMPTS, greedy)]
    want_chat = llm.chat(CHAT, greedy).text
    with ServerThread(build_app(llm.engine, served_model_name="smol")) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        got = client.completions.create(model="smol", prompt=PROMPTS, max_tokens=24, temperature=0)
        assert [c.text for c in got.choices] == want
        chat = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=24, temperature=0)
        assert chat.choices[0].message.content == want_chat
        stream = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=24, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_chat
        if drafter is not None:
            assert got.model_extra["dspark"]["accepted_tokens"] > 0
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
