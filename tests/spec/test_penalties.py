"""Penalties, logit biases and min_tokens: equal to transformers' logits processors (and the
presence/frequency formula) on a greedy loop over the same tiny model, the same with or without
speculation (greedy token for token, sampled in distribution), applied to every verify row with
the drafts before it counted, and never computed for a step where nobody asks."""

import math
from collections import Counter

import pytest
import torch
from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from dspark import LLM, SamplingParams
from dspark.sampling_params import ParamError
from dspark.worker.penalties import TokenHistory, penalised_logits
from test_logprobs import drafter_dir, target  # noqa: F401  (the same tiny target and drafter)
from tiny import save_random_drafter, save_tiny

VOCAB = 48
EOS = 2                                       # the tiny config's eos_token_id
PROMPTS = [[5, 9, 12, 7, 30, 3, 3, 8, 21], [40, 41, 6], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
CASES = {
    "repetition": dict(repetition_penalty=1.6),
    "repetition_below_one": dict(repetition_penalty=0.7),
    "presence": dict(presence_penalty=0.6),
    "frequency": dict(frequency_penalty=0.3),
    "negative": dict(presence_penalty=-0.5, frequency_penalty=-0.3),
    "bias": dict(logit_bias={4: 2.5, 35: -3.0, 46: 1.0}),
    "all": dict(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2,
                logit_bias={4: 2.0, 10: 1.5}),
}   # mild enough that the drafter (which favours repeating the last token) still gets drafts in


def make_llm(target_dir, drafter_dir=None, **kw):
    per_token = 2 * (4 + 1) * 2 * 16 * 4       # K+V of 4 target + 1 drafter layers, fp32
    spec = dict(spec_schedule="verify-all") if drafter_dir else {}
    return LLM(target_dir, dtype="float32", drafter=drafter_dir, block_size=4, kv_cache_bytes=4096 * per_token,
               max_model_len=128, graph="eager", **spec, **kw)


@pytest.fixture(scope="module")
def plain(target):
    return make_llm(target[0])


@pytest.fixture(scope="module")
def spec(target, drafter_dir):
    return make_llm(target[0], drafter_dir)


def greedy(n=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **{"ignore_eos": True, **kw})


def reference(hf, prompt: list[int], params: SamplingParams) -> list[int]:
    """transformers' greedy loop with its processors in vLLM's order (min_tokens, bias, repetition)
    and presence/frequency by their formula over the output (transformers has no processor)."""
    procs = LogitsProcessorList()
    if params.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, [EOS]))
    if params.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias.items()]))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    ids, out = list(prompt), []
    while len(out) < params.max_tokens:
        with torch.no_grad():
            input_ids = torch.tensor([ids])
            scores = procs(input_ids, hf(input_ids).logits[:, -1].float())[0]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=VOCAB).float()
        scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        out.append(int(scores.argmax()))
        ids.append(out[-1])
        if out[-1] == EOS and not params.ignore_eos:
            break
    return out


@pytest.mark.parametrize("case", CASES)
def test_greedy_equals_transformers_and_speculation_changes_nothing(target, plain, spec, case):
    _, hf = target
    params = greedy(**CASES[case])
    want = [reference(hf, p, params) for p in PROMPTS]
    assert want != [reference(hf, p, greedy()) for p in PROMPTS]           # the case changes the text
    before = spec.engine.spec_stats.draft_rounds, spec.engine.spec_stats.accepted_tokens
    assert [o.token_ids for o in plain.generate(PROMPTS, params)] == want
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    stats = spec.engine.spec_stats
    assert stats.draft_rounds > before[0] and stats.accepted_tokens > before[1]


def test_penalised_and_plain_requests_share_a_speculative_step(target, plain, spec):
    _, hf = target
    params = [greedy(**CASES["all"]), greedy(), greedy(**CASES["frequency"])]
    want = [reference(hf, p, sp) for p, sp in zip(PROMPTS, params)]
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    assert [o.token_ids for o in plain.generate(PROMPTS, params)] == want


def test_min_tokens_holds_back_eos_even_as_the_argmax(target, plain, spec):
    _, hf = target
    params = greedy(20, ignore_eos=False, min_tokens=5, logit_bias={EOS: 100.0})
    for llm in (plain, spec):
        for out in llm.generate(PROMPTS, params):
            assert EOS not in out.token_ids[:5] and out.token_ids[5] == EOS
            assert len(out.token_ids) == 6 and out.finish_reason == "stop"
            assert out.token_ids == reference(hf, out.prompt_token_ids, params)
        stop = greedy(20, min_tokens=3, stop_token_ids=[7], logit_bias={7: 100.0})
        assert all(o.token_ids == [*o.token_ids[:3], 7] and 7 not in o.token_ids[:3]
                   for o in llm.generate(PROMPTS, stop))
        sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=12, min_tokens=8, logit_bias={EOS: 4.0})
        for out in llm.generate(PROMPTS, sampled):
            assert EOS not in out.token_ids[:8] and len(out.token_ids) >= 8


def test_logit_bias_bans_and_forces(plain, spec):
    free = plain.generate(PROMPTS, greedy())
    common = Counter(t for o in free for t in o.token_ids).most_common(1)[0][0]
    for llm in (plain, spec):
        for params in (greedy(logit_bias={common: -100.0}),
                       SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True,
                                      logit_bias={common: -100.0})):
            assert all(common not in o.token_ids for o in llm.generate(PROMPTS, params))
        for params in (greedy(logit_bias={9: 100.0}),
                       SamplingParams(temperature=1.5, seed=2, max_tokens=24, ignore_eos=True,
                                      logit_bias={9: 100.0})):
            assert all(o.token_ids == [9] * 24 for o in llm.generate(PROMPTS, params))


def test_logprobs_stay_raw(target, plain, spec):
    """vLLM's raw_logprobs: the target's log-softmax, before any bias or penalty."""
    _, hf = target
    for llm in (plain, spec):
        out = llm.generate(PROMPTS[:1], greedy(8, logit_bias={9: 100.0}, presence_penalty=1.0, logprobs=1))[0]
        assert out.token_ids == [9] * 8
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0], -1)
        n = len(out.prompt_token_ids)
        for i, entry in enumerate(out.logprobs):
            assert entry[9] == pytest.approx(ref[n - 1 + i, 9].item(), abs=1e-4) and entry[9] < -0.1


def test_include_stop_str_in_output(tmp_path):
    from tiny_server import make_target
    llm = make_llm(make_target(str(tmp_path)))
    full = llm.generate(["w1 w2 w3"], greedy(12))[0].text
    stop = full.split()[3]
    at = full.find(stop)
    for include, end in ((False, at), (True, at + len(stop))):
        out = llm.generate(["w1 w2 w3"], greedy(12, stop=[stop], include_stop_str_in_output=include))[0]
        assert out.text == full[:end] and out.finish_reason == "stop" and out.stop_reason == stop
    first = full.split()[0]                      # a stop string within min_tokens tokens does not count
    assert llm.generate(["w1 w2 w3"], greedy(12, stop=[first]))[0].text == full[:full.find(first)]
    held = llm.generate(["w1 w2 w3"], greedy(12, stop=[first], min_tokens=2))[0]
    assert len(held.token_ids) > 2


def test_sampled_distribution_equals_plain(tmp_path_factory):
    """The first three tokens' joint distribution under penalties, with and without speculation
    (the drafter proposes from its own unpenalised q; rejection sampling corrects it)."""
    vocab = 8
    target = tmp_path_factory.mktemp("small_target")
    save_tiny(str(target), "llama", tied=True, vocab=vocab, num_hidden_layers=4, seed=2)
    d = tmp_path_factory.mktemp("small_drafter")
    save_random_drafter(str(d), str(target), gamma=3, copy_prev=1.0)
    n, prompt = 3000, [3, 5, 7]
    extra = dict(presence_penalty=1.5, frequency_penalty=0.8, repetition_penalty=1.4, logit_bias={4: 1.0})

    def dist(drafter_dir, **kw):
        llm = LLM(str(target), dtype="float32", drafter=drafter_dir, max_model_len=64, max_num_seqs=256,
                  graph="eager", **(dict(spec_schedule="verify-all") if drafter_dir else {}))
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True, **kw) for i in range(n)]
        return Counter(tuple(o.token_ids) for o in llm.generate([prompt] * n, params)), llm

    spec, llm = dist(str(d), **extra)
    plain, _ = dist(None, **extra)
    unpenalised, _ = dist(None)
    assert llm.engine.spec_stats.accepted_tokens > 0
    assert _tv(plain, unpenalised, n) > _bound(plain, unpenalised, n)           # the penalties matter
    assert _tv(spec, plain, n) < _bound(spec, plain, n)
    for view in (lambda k: k[1], lambda k: k[2], lambda k: k[2] == k[1]):   # sharper: fewer outcomes
        a, b = _marginal(spec, view), _marginal(plain, view)
        assert _tv(a, b, n) < _bound(a, b, n)


def _marginal(joint: Counter, view) -> Counter:
    out = Counter()
    for k, count in joint.items():
        out[view(k)] += count
    return out


def _tv(a: Counter, b: Counter, n: int) -> float:
    return 0.5 * sum(abs(a[k] - b[k]) / n for k in set(a) | set(b))


def _bound(a: Counter, b: Counter, n: int) -> float:
    """Two independent empirical distributions over K outcomes: E[TV] <= sqrt(K / n); 1.5x that."""
    return 1.5 * math.sqrt(len(set(a) | set(b)) / n)


def naive(logits: torch.Tensor, histories, params, num_rows, spec, drafts) -> torch.Tensor:
    """Row by row and token by token: what each row's prefix (output, then the drafts before it)
    asks for."""
    out, row, block = logits.clone(), 0, 0
    for h, p, n, s in zip(histories, params, num_rows, spec):
        for j in range(n):
            if h is not None:
                prefix = h.output_ids + (drafts[block, :j].tolist() if s else [])
                x = out[row + j]
                if len(h.output_ids) + j < p.min_tokens:
                    for t in h.stop_ids:
                        x[t] = float("-inf")
                for t, b in p.logit_bias.items():
                    x[t] += b
                for t in set(h.prompt_ids) | set(prefix):
                    x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
                for t in set(prefix):
                    x[t] -= p.frequency_penalty * prefix.count(t) + p.presence_penalty
        row, block = row + n, block + int(s)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_every_row_counts_the_drafts_before_it(seed):
    """The vectorised adjustment of mixed plain rows, speculative blocks and untouched requests
    equals the row-by-row reference."""
    g = torch.Generator().manual_seed(seed)
    v, gamma = 40, 5
    ints = lambda n: torch.randint(0, v, (n,), generator=g).tolist()  # noqa: E731
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.3,
                             logit_bias={3: 1.5, 7: -2.0}, min_tokens=6, max_tokens=20),
              SamplingParams(),
              SamplingParams(presence_penalty=-1.0, min_tokens=2),
              SamplingParams(repetition_penalty=0.6, logit_bias={1: 4.0}),
              SamplingParams(frequency_penalty=2.0)]
    histories = [TokenHistory(ints(4), ints(6), [2, 5]), None, TokenHistory(ints(1), [], [2]),
                 TokenHistory(ints(9), ints(3), []), TokenHistory([], [], [])]
    spec = [True, True, False, True, False]
    num_rows = [gamma + 1, 3, 1, 4, 1]
    drafts = torch.randint(0, v, (3, gamma), generator=g)
    logits = torch.randn(sum(num_rows), v, generator=g) * 3
    got = penalised_logits(logits, histories, params, num_rows, spec, drafts)
    assert torch.allclose(got, naive(logits, histories, params, num_rows, spec, drafts), atol=1e-5)
    assert torch.equal(got[gamma + 1:gamma + 4], logits[gamma + 1:gamma + 4])     # nobody asked
    assert penalised_logits(logits, [None] * 5, params, num_rows, spec, drafts) is logits


def test_nobody_asks_nothing_computed(plain, spec, monkeypatch):
    import dspark.worker.penalties as module

    def forbidden(*args, **kwargs):
        raise AssertionError("penalties computed for a step where nobody asked")

    monkeypatch.setattr(module, "_plan", forbidden)
    for llm in (plain, spec):
        params = [greedy(10), SamplingParams(temperature=0.8, seed=1, max_tokens=10), greedy(10, stop=["x"])]
        assert all(o.finish_reason == "length" for o in llm.generate(PROMPTS, params))
        failed = llm.generate(PROMPTS[:1], greedy(10, presence_penalty=0.5))[0]    # the patch bites
        assert failed.finish_reason == "error"


@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5), ("presence_penalty", math.nan), ("frequency_penalty", -2.01),
    ("frequency_penalty", True), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}),
    ("logit_bias", {5: 101.0}), ("logit_bias", {5: "x"}), ("logit_bias", [(5, 1.0)]), ("min_tokens", -1), ("min_tokens", 17),
    ("min_tokens", 1.5), ("include_stop_str_in_output", 1)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ParamError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and field in str(info.value)


def test_a_bias_outside_the_vocabulary_is_refused(plain):
    with pytest.raises(ParamError) as info:
        plain.generate(PROMPTS[:1], greedy(logit_bias={VOCAB: 1.0}))
    assert info.value.param == "logit_bias" and f"[0, {VOCAB})" in str(info.value)
