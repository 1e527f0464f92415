"""Continuous batching must be invisible: batched greedy output equals each request alone."""

import random

import pytest
import torch

from dspark import LLM, SamplingParams
from tiny import run_staggered, save_tiny

BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny(str(path), "llama", tied=False, seed=3)
    return str(path)


def make_llm(model_dir, kv_tokens=4096, **kw):
    per_token = 2 * 2 * 2 * 16 * 4          # K+V, 2 layers, 2 kv heads, head_dim 16, fp32
    return LLM(model_dir, dtype="float32", block_size=BLOCK, kv_cache_bytes=kv_tokens * per_token,
               max_model_len=256, graph="eager", **kw)


def requests(n=16, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(3, 40))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(4, 30), ignore_eos=True)
              for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def alone(model_dir):
    llm = make_llm(model_dir)
    prompts, params = requests()
    return [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


def test_submitted_together(model_dir, alone):
    llm = make_llm(model_dir, max_num_batched_tokens=48)
    prompts, params = requests()
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert all(len(o.token_ids) == sp.max_tokens for o, sp in zip(outs, params))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_staggered_arrivals(model_dir, alone):
    llm = make_llm(model_dir, max_num_batched_tokens=32)
    assert run_staggered(llm, *requests()) == alone


@pytest.mark.parametrize("staggered", [False, True])
def test_preempting_kv_budget(model_dir, alone, staggered):
    llm = make_llm(model_dir, kv_tokens=256, max_num_batched_tokens=64)
    prompts, params = requests()
    got = run_staggered(llm, prompts, params) if staggered else [o.token_ids for o in llm.generate(prompts, params)]
    assert got == alone
    assert llm.engine.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_seeded_sampling_is_independent_of_batch(model_dir):
    llm = make_llm(model_dir)
    prompts, _ = requests(6, seed=5)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=100 + i, max_tokens=12,
                             ignore_eos=True) for i in range(6)]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert batched == alone
    reseeded = llm.generate(prompts[:1], SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True))
    other = llm.generate(prompts[:1], SamplingParams(temperature=0.9, seed=8, max_tokens=12, ignore_eos=True))
    again = llm.generate(prompts[:1], SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True))
    assert reseeded[0].token_ids == again[0].token_ids != other[0].token_ids


def test_stop_token_ids_and_eos(model_dir, alone):
    llm = make_llm(model_dir)
    prompts, params = requests()
    ref = alone[0]
    stop_at = ref[2]
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == ref[:ref.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "length"


def test_abort_frees_blocks(model_dir):
    llm = make_llm(model_dir)
    engine = llm.engine
    prompts, params = requests(4)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for rid in rids:
        assert engine.abort(rid)
    assert not engine.has_unfinished
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.abort(rids[0])


def test_streamed_text_never_retracts_a_stop_string():
    from dspark.engine.output_processor import _stop_prefix_len
    assert _stop_prefix_len("hello wor", ["world"]) == 3
    assert _stop_prefix_len("hello", ["xyz", "lo!"]) == 2
    assert _stop_prefix_len("hello", []) == 0


def test_prompt_longer_than_the_step_budget_is_prefilled_in_chunks(model_dir):
    whole = make_llm(model_dir).generate([list(range(3, 60))], SamplingParams(temperature=0, max_tokens=5))
    llm = make_llm(model_dir, max_num_batched_tokens=8)      # 57 prompt tokens: 8 steps of chunks
    chunked = llm.generate([list(range(3, 60))], SamplingParams(temperature=0, max_tokens=5))
    assert chunked[0].token_ids == whole[0].token_ids and len(whole[0].token_ids) == 5
