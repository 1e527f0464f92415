"""64 concurrent streaming clients, a third of them leaving mid-stream: everyone else gets exactly
the text their request produces alone, and afterwards every KV block is free (engine and /metrics)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import openai
import pytest

from dspark import LLM, SamplingParams
from tiny_server import engine_kwargs, serve

NUM_CLIENTS = 64
MAX_MODEL_LEN = 256
KV_TOKENS = NUM_CLIENTS * MAX_MODEL_LEN       # no preemption: leavers must still be running


@dataclass
class Job:
    prompt: str
    max_tokens: int
    disconnect: bool


def jobs(seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    out = []
    for i in range(NUM_CLIENTS):
        prompt = " ".join(f"w{rng.randrange(0, 120)}" for _ in range(rng.randrange(2, 20)))
        leaves = i % 3 == 0
        out.append(Job(prompt, 220 if leaves else rng.randrange(4, 24), leaves))   # leavers: long
    return out


async def run_client(client: openai.AsyncOpenAI, job: Job) -> str | None:
    stream = await client.completions.create(model="tiny", prompt=job.prompt, max_tokens=job.max_tokens,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    text, chunks = "", 0
    async for chunk in stream:
        chunks += 1
        text += "".join(c.text for c in chunk.choices)
        if job.disconnect and chunks >= 3:
            await stream.close()
            return None
    return text


async def run_all(base_url: str, work: list[Job]) -> list[str | None]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    try:
        return await asyncio.gather(*(run_client(client, job) for job in work))
    finally:
        await client.close()


@pytest.mark.parametrize("mode", ["plain", "dspark"])
def test_concurrent_streams_with_disconnects(mode, target_dir, drafter_dir):
    drafter = drafter_dir if mode == "dspark" else None
    work = jobs()
    kw = engine_kwargs(kv_tokens=KV_TOKENS, max_model_len=MAX_MODEL_LEN)
    offline = LLM(target_dir, drafter=drafter, **kw)
    alone = {i: offline.generate([j.prompt], SamplingParams(temperature=0, max_tokens=j.max_tokens,
                                                           ignore_eos=True))[0].text
             for i, j in enumerate(work) if not j.disconnect}
    with serve(target_dir, drafter, kv_tokens=KV_TOKENS, max_model_len=MAX_MODEL_LEN) as served:
        texts = asyncio.run(run_all(served.base_url, work))
        values = served.wait_idle()
        engine = served.state.engine
        assert {i: t for i, t in enumerate(texts) if not work[i].disconnect} == alone
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert not engine.has_unfinished and not engine.requests
        assert values[("dspark_kv_cache_free_blocks", ())] == engine.block_manager.num_blocks
        assert values[("dspark_kv_cache_blocks", ())] == engine.block_manager.num_blocks
        assert values[("dspark_kv_cache_usage_ratio", ())] == 0
        leavers = sum(j.disconnect for j in work)
        assert values[("dspark_requests_aborted_total", ())] == leavers
        assert values[("dspark_requests_finished_total", (("finish_reason", "length"),))] == len(alone)
        key = ("dspark_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
        assert values[key] == NUM_CLIENTS
        if mode == "dspark":
            assert values[("dspark_spec_accepted_tokens_total", ())] > 0
            predicted = values[("dspark_spec_predicted_accepted_tokens_total", ())]
            assert predicted == pytest.approx(engine.spec_stats.predicted_accepted_tokens) and predicted > 0
