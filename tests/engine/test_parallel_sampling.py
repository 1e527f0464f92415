"""Parallel sampling (n > 1): vLLM's seed rule, the prompt prefilled once on shared blocks, and
the completions exactly what single requests give, with and without a drafter, under preemption."""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams
from dspark.engine.parallel_sampling import child_params, request_ids
from dspark.sampling_params import MAX_N, ParamError
from tiny import save_random_drafter, save_tiny

VOCAB = 32
BLOCK = 4
PROMPTS = [[3 + (7 * i) % 25 for i in range(13)],      # 3 full blocks shared, 1 token each computes
           [5 + (3 * i) % 20 for i in range(16)],      # 3 shared (the last block is the tail), 4 each
           [9, 4, 11]]                                 # under one block: nothing to share


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    save_tiny(str(path), "qwen3", tied=True, vocab=VOCAB, num_hidden_layers=4, seed=11)
    return str(path)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target_dir):
    path = tmp_path_factory.mktemp("drafter")
    save_random_drafter(str(path), target_dir, gamma=4, copy_prev=9.0)
    return str(path)


def make_llm(target_dir, drafter=None, kv_tokens=4096, max_model_len=128, **kw) -> LLM:
    per_token = 2 * (4 + 1) * 2 * 16 * 4       # K+V of 4 target + 1 drafter layers, fp32
    llm = LLM(target_dir, dtype="float32", drafter=drafter, block_size=BLOCK, graph="eager",
              kv_cache_bytes=kv_tokens * per_token, max_model_len=max_model_len, **kw)
    if getattr(llm.engine, "policy", None) is not None:    # drafts priced as free: all speculate
        from dspark.spec.planner import CostTable
        policy = llm.engine.policy
        policy.table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * policy.table.max_tokens,
                                 draft_ms=[0.0] + [1e-6] * policy.table.max_requests)
        policy.min_gain = 0.0
    return llm


def sampled(seed: int | None = 7, n: int = 1, max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, n=n, max_tokens=max_tokens,
                          ignore_eos=True, **kw)


def greedy_n(n: int, max_tokens: int = 24) -> SamplingParams:
    """Greedy params with n > 1, which SamplingParams refuses as vLLM does: set past the check to
    test the sharing itself, whose greedy completions must each equal plain greedy decoding."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    params.n = n
    return params


def singles(llm: LLM, prompt, params: SamplingParams) -> list[list[int]]:
    """What requests of their own with each completion's params (vLLM's seed rule) return."""
    return [llm.generate([prompt], child_params(params, i))[0].token_ids for i in range(params.n)]


def test_the_seed_rule_is_vllms():
    params = sampled(seed=40, n=3)
    assert [child_params(params, i).seed for i in range(3)] == [40, 41, 42]
    assert all(child_params(params, i).n == 1 for i in range(3))
    assert child_params(sampled(seed=None, n=3), 2).seed is None
    assert request_ids("r", 1) == ["r"] and request_ids("r", 3) == ["0_r", "1_r", "2_r"]


@pytest.mark.parametrize("mode", ["plain", "dspark"])
def test_n_completions_equal_single_seeded_requests(target_dir, drafter_dir, mode):
    llm = make_llm(target_dir, drafter_dir if mode == "dspark" else None)
    params = sampled(seed=7, n=4)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        got = [c.token_ids for c in out.outputs]
        assert got == singles(llm, prompt, params)
        assert out.token_ids == got[0] and out.text == out.outputs[0].text
        assert len({tuple(t) for t in got}) > 1                 # four samples, not one repeated
        assert all(c.finish_reason == "length" for c in out.outputs)
    if mode == "dspark":
        assert llm.engine.spec_stats.draft_rounds > 0 and llm.engine.spec_stats.accepted_tokens > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.scheduler.parallel.groups


@pytest.mark.parametrize("mode", ["plain", "dspark"])
def test_greedy_children_equal_plain_greedy(target_dir, drafter_dir, mode):
    reference = make_llm(target_dir)
    llm = make_llm(target_dir, drafter_dir if mode == "dspark" else None, max_num_batched_tokens=6)
    outs = llm.generate(PROMPTS, greedy_n(3))            # prompts prefilled in chunks of 6
    for prompt, out in zip(PROMPTS, outs):
        plain = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                            ignore_eos=True))[0].token_ids
        assert [c.token_ids for c in out.outputs] == [plain] * 3


def test_greedy_with_n_is_refused_as_in_vllm():
    with pytest.raises(ParamError, match="n must be 1 when using greedy sampling") as info:
        SamplingParams(temperature=0, n=2)
    assert info.value.param == "n"


@pytest.mark.parametrize("kw,param", [(dict(n=0), "n"), (dict(n=-1), "n"), (dict(n=MAX_N + 1), "n"),
                                      (dict(n=2.0), "n"), (dict(n=True), "n"),
                                      (dict(n=3, seed=2 ** 63 - 2), "seed")])
def test_bad_n(kw, param):
    with pytest.raises(ParamError) as info:
        SamplingParams(**kw)
    assert info.value.param == param


def prefill_rows(llm: LLM, prompt_len: int) -> list[int]:
    """Counts the rows the target runs over prompt positions (wrapping the worker's step)."""
    worker, count = llm.engine.worker, [0]
    real = worker.execute

    def counting(batch, key=None):
        for chunk in batch.chunks:
            count[0] += max(0, min(chunk.start + len(chunk.token_ids), prompt_len) - chunk.start)
        return real(batch, key)

    worker.execute = counting
    return count


def run(engine) -> dict:
    outs = {}
    while engine.has_unfinished:
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return outs


@pytest.mark.parametrize("max_tokens", [1, 8])
def test_the_prompt_is_prefilled_once_on_shared_blocks(target_dir, max_tokens):
    llm = make_llm(target_dir)
    engine, bm, prompt = llm.engine, llm.engine.block_manager, PROMPTS[0]      # 13 tokens, 4 blocks
    used = lambda: bm.num_blocks - bm.num_free_blocks  # noqa: E731
    rows = prefill_rows(llm, len(prompt))
    parent = engine.add_request(prompt, sampled(n=4, max_tokens=max_tokens))
    group = engine.scheduler.parallel.groups[parent]
    outs = {o.request_id: o for o in engine.step()}      # the first completion prefills all 13
    if max_tokens == 1:                                  # it finished: the group keeps 3 full blocks
        assert used() == 3 and [bm.ref_counts[b] for b in group.blocks] == [1] * 3
    else:
        assert used() == 4 and group.blocks is None and engine.scheduler.num_waiting == 3
        engine.step()                                    # the others attach: 1 own block each
        assert used() == 4 + 3                           # not 4 x 4
        assert [bm.ref_counts[b] for b in group.blocks] == [5] * 3      # 4 tables + the group
    outs.update(run(engine))
    assert rows[0] == 13 + 3 * 1                         # the prompt once, then the last token each
    got = [outs[i].token_ids for i in request_ids(parent, 4)]
    assert got == singles(make_llm(target_dir), prompt, sampled(n=4, max_tokens=max_tokens))
    assert bm.num_free_blocks == bm.num_blocks and not engine.scheduler.parallel.groups


def test_siblings_wait_parked_while_the_prompt_is_computed(target_dir):
    """Chunked prefill: the others wait outside the queue, so a later request is admitted."""
    llm = make_llm(target_dir, max_num_batched_tokens=10)
    engine, sched = llm.engine, llm.engine.scheduler
    parent = engine.add_request(PROMPTS[1], sampled(n=3, max_tokens=4))     # 16 tokens, 12 shared
    engine.step()                                        # the first completion: 10 prompt tokens
    other = engine.add_request([4, 5], sampled(max_tokens=4))
    engine.step()                                        # its last 6; the others park
    assert not sched.waiting and sched.num_waiting == 2 and engine.requests[other] in sched.running
    engine.step()                                        # 12 shared: the others attach
    assert sched.parallel.groups[parent].blocks is not None and sched.num_waiting == 0
    outs = run(engine)
    assert [outs[i].token_ids for i in request_ids(parent, 3)] == singles(
        make_llm(target_dir), PROMPTS[1], sampled(n=3, max_tokens=4))


def test_preempted_completions_recompute_exactly(target_dir, drafter_dir):
    """A small cache: completions are preempted and recompute, sharing the prompt again."""
    reference = make_llm(target_dir)
    prompts = PROMPTS + [[6, 7, 8, 9, 10] * 3, [12] * 9]
    small = dict(kv_tokens=96, max_model_len=64, max_num_batched_tokens=24)
    llm = make_llm(target_dir, **small)
    params = [sampled(seed=3 + i, n=3, max_tokens=30) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, sp, out in zip(prompts, params, outs):
        assert [c.token_ids for c in out.outputs] == singles(reference, prompt, sp)
    spec = make_llm(target_dir, drafter_dir, **small)   # greedy: exactly plain decoding
    outs = spec.generate(prompts, greedy_n(3, max_tokens=30))
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.spec_stats.draft_rounds > 0
    for prompt, out in zip(prompts, outs):
        plain = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                            ignore_eos=True))[0].token_ids
        assert [c.token_ids for c in out.outputs] == [plain] * 3
    for engine in (llm.engine, spec.engine):
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not engine.scheduler.parallel.groups


def test_abort_a_request_or_one_completion(target_dir):
    llm = make_llm(target_dir)
    engine, bm = llm.engine, llm.engine.block_manager
    first = engine.add_request(PROMPTS[0], sampled(n=3, max_tokens=20))
    second = engine.add_request(PROMPTS[1], sampled(n=3, max_tokens=6))
    engine.step()
    engine.step()
    assert engine.abort(first) and not engine.abort(first)
    assert engine.abort(request_ids(second, 3)[1])        # one completion; the others go on
    outs = run(engine)
    assert sorted(outs) == sorted(request_ids(second, 3)[::2])
    assert bm.num_free_blocks == bm.num_blocks and not engine.scheduler.parallel.groups


def same_logprobs(a, b) -> bool:
    """Equal token ids, log-probs equal up to float rounding (a row in a chunk of its own vs
    inside the prompt's chunk)."""
    return len(a) == len(b) and all(
        (x is None and y is None) or (list(x) == list(y) and list(x.values()) == pytest.approx(list(y.values())))
        for x, y in zip(a, b))


def test_prompt_logprobs_of_the_shared_part(target_dir):
    """A completion that starts on the shared blocks has the prompt log-probs of the one that
    computed them."""
    llm = make_llm(target_dir)
    params = sampled(n=3, max_tokens=4, prompt_logprobs=2, logprobs=1)
    parent = llm.engine.add_request(PROMPTS[0], params)
    outs = run(llm.engine)
    alone = llm.generate([PROMPTS[0]], child_params(params, 2))[0]
    third = outs[request_ids(parent, 3)[2]]
    assert len(third.prompt_logprobs) == 13 and same_logprobs(third.prompt_logprobs, alone.prompt_logprobs)
    assert third.token_ids == alone.token_ids and same_logprobs(third.logprobs, alone.logprobs)
    merged = llm.generate([PROMPTS[0]], params)[0]
    assert same_logprobs(merged.prompt_logprobs, alone.prompt_logprobs)
    completion = merged.outputs[2]
    assert completion.token_ids == alone.token_ids
    chosen = [entry[token] for entry, token in zip(alone.logprobs, alone.token_ids)]
    assert completion.cumulative_logprob == pytest.approx(sum(chosen))


@pytest.mark.slow                        # starts a group of two rank processes (seconds)
def test_data_parallel_routes_a_request_with_its_completions(target_dir):
    llm = make_llm(target_dir, data_parallel_size=2, dp_timeout_s=20.0)
    try:
        params = [sampled(seed=5, n=3, max_tokens=12), sampled(seed=9, n=2, max_tokens=12)]
        outs = llm.generate(PROMPTS[:2], params)
        reference = make_llm(target_dir)
        for prompt, sp, out in zip(PROMPTS[:2], params, outs):
            assert [c.token_ids for c in out.outputs] == singles(reference, prompt, sp)
        engine = llm.engine
        parent = engine.add_request(PROMPTS[0], sampled(n=3, max_tokens=40))
        assert set(engine.requests) == set(request_ids(parent, 3))
        assert len({engine.requests[i] for i in request_ids(parent, 3)}) == 1     # one rank
        engine.step()
        assert engine.abort(request_ids(parent, 3)[0]) and engine.abort(parent)
        assert not engine.abort(parent)
        while engine.has_unfinished:
            engine.step()
        assert not engine.requests
    finally:
        llm.close()
