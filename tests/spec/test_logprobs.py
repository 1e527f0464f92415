"""Log-probabilities are the target's raw ones at the row that committed each token: equal to
transformers' log-softmax of the same tiny model, the same with or without a drafter (greedy,
fp32), right for seeded sampling, for the prompt (chunked or preempted), and computed for
nobody who did not ask."""

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.sampling_params import ParamError
from tiny import save_random_drafter, save_tiny, speculating

VOCAB = 48
PROMPTS = [[5, 9, 12, 7, 30, 3, 3, 8, 21], [40, 41, 6], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 22, 23, 24]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    hf = save_tiny(str(path), "qwen3", tied=True, vocab=VOCAB, num_hidden_layers=4, seed=3)
    return str(path), hf


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target):
    path = tmp_path_factory.mktemp("drafter")
    save_random_drafter(str(path), target[0], gamma=4, copy_prev=9.0)
    return str(path)


def make_llm(target_dir, drafter_dir=None, kv_tokens=4096, max_model_len=128, **kw):
    per_token = 2 * (4 + 1) * 2 * 16 * 4       # K+V of 4 target + 1 drafter layers, fp32
    return speculating(LLM(target_dir, dtype="float32", drafter=drafter_dir, block_size=4,
                           kv_cache_bytes=kv_tokens * per_token, max_model_len=max_model_len,
                           graph="eager", **kw))


@pytest.fixture(scope="module")
def plain(target):
    return make_llm(target[0])


@pytest.fixture(scope="module")
def spec(target, drafter_dir):
    return make_llm(target[0], drafter_dir)


def reference(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: transformers' log-softmax at every position (row p predicts token p + 1)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def greedy(n=12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_greedy_logprobs_equal_transformers(target, plain):
    _, hf = target
    for out in plain.generate(PROMPTS, greedy(logprobs=5)):
        ref = reference(hf, out.prompt_token_ids + out.token_ids)
        n = len(out.prompt_token_ids)
        assert len(out.logprobs) == len(out.token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert next(iter(entry)) == token and 5 <= len(entry) <= 6
            assert entry[token] == max(entry.values())                        # greedy: the top one
            for t, value in entry.items():
                assert value == pytest.approx(ref[n - 1 + i, t].item(), abs=1e-4)
            top5 = ref[n - 1 + i].topk(5).indices.tolist()
            assert set(top5) <= set(entry)


@pytest.mark.parametrize("budget", [None, 4])
def test_prompt_logprobs_equal_transformers(target, budget):
    """Also with chunked prefill: every chunk contributes its rows."""
    path, hf = target
    llm = make_llm(path, max_num_batched_tokens=budget) if budget else make_llm(path)
    outs = llm.generate(PROMPTS, greedy(n=2, prompt_logprobs=3))
    for out in outs:
        ids = out.prompt_token_ids
        ref = reference(hf, ids)
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        assert out.logprobs is None
        for p in range(1, len(ids)):
            entry = out.prompt_logprobs[p]
            assert next(iter(entry)) == ids[p] and 3 <= len(entry) <= 4
            for t, value in entry.items():
                assert value == pytest.approx(ref[p - 1, t].item(), abs=1e-4)


def test_speculative_equals_plain(plain, spec):
    """Drafted, accepted, recovered or bonus: the same tokens and log-probs as plain decoding,
    beside requests that ask for nothing."""
    params = [greedy(30, logprobs=4, prompt_logprobs=2), greedy(30), greedy(25, logprobs=0)]
    want = plain.generate(PROMPTS, params)
    got = spec.generate(PROMPTS, params)
    assert spec.engine.spec_stats.accepted_tokens > 0
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert (g.logprobs is None) == (w.logprobs is None)
        for we, ge in zip(w.logprobs or [], g.logprobs or []):
            assert list(ge) == list(we)
            assert all(abs(ge[t] - we[t]) <= 1e-5 for t in we)
    assert got[1].logprobs is None and got[1].prompt_logprobs is None
    assert [len(e) for e in got[2].logprobs] == [1] * 25
    for ge, we in zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:]):
        assert list(ge) == list(we) and all(abs(ge[t] - we[t]) <= 1e-5 for t in we)


@pytest.mark.parametrize("use_drafter", [False, True])
def test_seeded_sampling_logprobs_are_the_targets(target, plain, spec, use_drafter):
    """Raw log-probs (before temperature and top-k) of the tokens actually sampled."""
    _, hf = target
    llm = spec if use_drafter else plain
    params = SamplingParams(temperature=1.3, top_k=20, seed=7, max_tokens=20, ignore_eos=True, logprobs=2)
    for out in llm.generate(PROMPTS, params):
        ref = reference(hf, out.prompt_token_ids + out.token_ids)
        n = len(out.prompt_token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert next(iter(entry)) == token
            assert entry[token] == pytest.approx(ref[n - 1 + i, token].item(), abs=1e-4)
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_preempted_requests_keep_their_logprobs(target, drafter_dir):
    """Recompute after preemption neither repeats nor loses a prompt or output entry."""
    path, hf = target
    llm = make_llm(path, drafter_dir, kv_tokens=64, max_model_len=48, max_num_batched_tokens=16)
    params = greedy(30, logprobs=1, prompt_logprobs=1)
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        ref = reference(hf, out.prompt_token_ids + out.token_ids)
        n = len(out.prompt_token_ids)
        assert len(out.prompt_logprobs) == n and len(out.logprobs) == len(out.token_ids)
        for p, token in enumerate(out.prompt_token_ids[1:], start=1):
            assert out.prompt_logprobs[p][token] == pytest.approx(ref[p - 1, token].item(), abs=1e-4)
        for i, token in enumerate(out.token_ids):
            assert out.logprobs[i][token] == pytest.approx(ref[n - 1 + i, token].item(), abs=1e-4)


def test_nobody_asks_nothing_computed(plain, spec, monkeypatch):
    import dspark.worker.logprobs as module

    def forbidden(*args, **kwargs):
        raise AssertionError("log-probs computed for a request that did not ask")

    monkeypatch.setattr(module, "row_logprobs", forbidden)
    for llm in (plain, spec):
        outs = llm.generate(PROMPTS, greedy(10))
        assert all(o.logprobs is None and o.prompt_logprobs is None for o in outs)


@pytest.mark.parametrize("field,value", [("logprobs", -1), ("logprobs", 21), ("prompt_logprobs", 2.5),
                                         ("prompt_logprobs", True)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ParamError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and field in str(info.value)
