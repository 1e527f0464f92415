"""Sampler: each truncation against a hand computation, and the sampled distribution itself."""

import math

import pytest
import torch

from dspark.sampling_params import SamplingParams
from dspark.spec.sampler import NoiseKey, SamplingTensors, _mix, processed_logits, processed_probs, sample


def tensors(params, gens=None, vocab=5):
    return SamplingTensors.build(params, gens or [None] * len(params), vocab, torch.device("cpu"))


LOGITS = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))


def test_greedy_is_argmax():
    logits = torch.randn(7, 50)
    st = SamplingTensors.build([SamplingParams(temperature=0)] * 7, [None] * 7, 50, torch.device("cpu"))
    assert torch.equal(sample(logits, st), logits.argmax(-1))


@pytest.mark.parametrize("kwargs,expected", [
    (dict(top_k=2), [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]),
    (dict(top_p=0.7), [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]),
    (dict(top_p=0.71), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0]),
    (dict(min_p=0.3), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0]),
    (dict(top_k=3, top_p=0.5), [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]),
])
def test_truncation_matches_hand_computation(kwargs, expected):
    probs = processed_probs(LOGITS, tensors([SamplingParams(temperature=1.0, **kwargs)]))
    assert torch.allclose(probs[0], torch.tensor(expected), atol=1e-6)


def test_temperature_scales_logits():
    probs = processed_probs(LOGITS, tensors([SamplingParams(temperature=0.5)]))
    ref = torch.softmax(LOGITS[0] / 0.5, -1)
    assert torch.allclose(probs[0], ref, atol=1e-6)


def test_empirical_distribution_matches():
    n = 20000
    logits = LOGITS.expand(n, 5).contiguous()
    st = tensors([SamplingParams(temperature=1.0)] * n)
    counts = torch.bincount(sample(logits, st), minlength=5).float() / n
    tv = 0.5 * (counts - torch.exp(LOGITS[0])).abs().sum().item()
    # 5 categories: E[TV] <= 0.5 * sum sqrt(p(1-p)/n); allow 4x that
    bound = 4 * 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in torch.exp(LOGITS[0]).tolist())
    assert tv < bound, (tv, bound)


def test_seeded_rows_are_reproducible_and_mixed_batches_work():
    logits = torch.randn(3, 40)
    def draw():
        gens = [NoiseKey(5, 12), None, NoiseKey(9, 12)]
        params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0),
                  SamplingParams(temperature=1.0, seed=9)]
        return [sample(logits, tensors(params, gens, vocab=40)).tolist() for _ in range(1)][0]
    a, b = draw(), draw()
    assert a == b
    assert a[1] == int(logits[1].argmax())


@pytest.mark.parametrize("bad,match", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-3), "top_k"), (dict(min_p=2.0), "min_p"),
    (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_params(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


@pytest.mark.parametrize("scale,top_k,top_p", [(4.0, 0, 0.9), (4.0, 50, 0.95), (4.0, 300, 0.0),
                                                (0.01, 0, 0.99), (4.0, 20, 1.0), (2.0, 1000, 0.5)])
def test_candidate_truncation_equals_full_sort(monkeypatch, scale, top_k, top_p):
    """The top-candidates shortcut is exact, and falls back when the kept set is larger."""
    import dspark.spec.sampler as sampler
    logits = torch.randn(6, 2000, generator=torch.Generator().manual_seed(3)) * scale
    st = SamplingTensors.build([SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p or 1.0)] * 6,
                               [None] * 6, 2000, torch.device("cpu"))
    fast = processed_probs(logits, st)
    monkeypatch.setattr(sampler, "CANDIDATES", 10**9)
    full = processed_probs(logits, st)
    assert torch.allclose(fast, full, atol=1e-6)


def test_candidate_sampling_matches_the_full_vocabulary_distribution():
    """A vocabulary larger than the candidate window, truncated by top-p inside it: `sample`
    draws from the candidates only, and its empirical distribution is processed_probs'."""
    from dspark.spec.sampler import CANDIDATES, candidate_logits
    v, n = CANDIDATES * 4, 20000
    g = torch.Generator().manual_seed(0)
    row = torch.randn(v, generator=g) * 0.5
    row[:6] += torch.tensor([9.0, 8.5, 8.0, 7.0, 6.5, 6.0])         # mass concentrated on a few
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * n
    st = SamplingTensors.build(params, [None] * n, v, torch.device("cpu"))
    logits = row.expand(n, v).contiguous()
    full = processed_probs(logits[:1], st.select([0]))[0]
    sparse = candidate_logits(logits[:1], st.select([0]))
    assert sparse is not None
    scores, index, fits = sparse
    assert fits == [True]
    dense = torch.zeros(v).index_put_((index[0],), torch.softmax(scores[0], dim=-1))
    assert torch.allclose(dense, full, atol=1e-6)
    counts = torch.bincount(sample(logits, st), minlength=v).float() / n
    support = full > 0
    assert counts[~support].sum() == 0                               # never outside top-p
    tv = 0.5 * (counts - full).abs().sum().item()
    bound = 4 * 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in full[support].tolist())
    assert tv < bound, (tv, bound)


def test_candidate_sampling_falls_back_when_the_kept_set_is_wider():
    from dspark.spec.sampler import CANDIDATES, candidate_logits
    v = CANDIDATES * 4
    flat = torch.zeros(2, v)                                         # top-p 0.9 keeps 90% of v
    st = tensors([SamplingParams(temperature=1.0, top_p=0.9)] * 2, vocab=v)
    assert candidate_logits(flat, st)[2] == [False, False]
    tokens = sample(flat, st)
    assert tokens.shape == (2,) and bool((tokens < v).all())
    # greedy rows never block the candidate path
    mixed = tensors([SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=3)], vocab=v)
    logits = torch.randn(2, v)
    assert candidate_logits(logits, mixed)[2] == [True, True]
    out = sample(logits, mixed)
    assert int(out[0]) == int(logits[0].argmax()) and int(out[1]) in logits[1].topk(3).indices.tolist()


def test_a_seeded_rows_noise_is_a_function_of_its_seed_and_position():
    from dspark.spec.sampler import gumbel_noise
    keys = [NoiseKey(3, 10), None, NoiseKey(4, 10), NoiseKey(3, 11)]
    noise = gumbel_noise(4, 50, keys, torch.device("cpu"))
    for row, (seed, position) in ((0, (3, 10)), (2, (4, 10)), (3, (3, 11))):
        ref = torch.empty(50).exponential_(generator=torch.Generator().manual_seed(_mix(seed, position)))
        assert torch.equal(noise[row], -ref.log())
    assert bool(noise[1].isfinite().all()) and not torch.equal(noise[1], noise[0])
    assert torch.equal(gumbel_noise(4, 50, keys, torch.device("cpu"))[[0, 2, 3]], noise[[0, 2, 3]])
    index = torch.tensor([[7, 2, 40]] * 4)
    assert torch.equal(gumbel_noise(4, 50, keys, torch.device("cpu"), index)[[0, 2, 3]],
                       noise[[0, 2, 3]][:, [7, 2, 40]])
    assert len({_mix(s, t) for s in range(50) for t in range(50)}) == 2500    # seed + i, t + 1 differ


def test_a_seeded_rows_draw_does_not_depend_on_its_batch_or_path():
    """A row that fits the candidates beside one that does not (so the batch takes both paths):
    each seeded row still samples what it samples alone, and what the full race would give."""
    from dspark.spec.sampler import CANDIDATES
    v = CANDIDATES * 4
    peaked = torch.zeros(v)
    peaked[[700, 3, 400, 9, 250]] = torch.tensor([3.0, 2.8, 2.6, 2.4, 2.2]) + 8.0   # not in id order
    flat = torch.zeros(v)
    alone, mixed, full = [], [], []
    for seed in range(40):
        p = SamplingParams(temperature=1.0, top_p=0.9, seed=seed)
        alone.append(int(sample(peaked[None], tensors([p], [NoiseKey(seed, 5)], vocab=v))[0]))
        both = sample(torch.stack([peaked, flat]), tensors([p, p], [NoiseKey(seed, 5), NoiseKey(seed + 100, 5)],
                                                           vocab=v))
        mixed.append(int(both[0]))
        scores = processed_logits(peaked[None], tensors([p], vocab=v))[0]
        noise = torch.empty(v).exponential_(generator=torch.Generator().manual_seed(_mix(seed, 5)))
        full.append(int((scores - noise.log()).argmax()))
    assert alone == mixed == full and len(set(alone)) > 1


def test_unseeded_noise_is_the_global_generators_exponential_bit_for_bit():
    from dspark.spec.sampler import global_exponentials
    for shape in [(1, 7), (3, 5, 600), (2, 49153)]:
        torch.manual_seed(9)
        want, want_next = torch.empty(shape).exponential_(), torch.rand(2)
        torch.manual_seed(9)
        got = global_exponentials(shape, torch.device("cpu"))
        assert torch.equal(got, want) and torch.equal(torch.rand(2), want_next)


def test_seeded_exponentials_equal_torch_exponential():
    from dspark.spec import sampler
    for seed, size, count in [(0, 1, 1), (5, 49153, 3), (2 ** 40 + 7, 1000, 7)]:
        a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = torch.stack([torch.empty(size).exponential_(generator=a) for _ in range(count)])
        assert torch.equal(sampler.seeded_exponentials(b, count, size, torch.device("cpu")), want)


@pytest.mark.cuda
def test_a_seeded_rows_noise_is_drawn_on_the_gpu():
    from dspark.spec.sampler import keyed_gumbels
    if not torch.cuda.is_available():
        pytest.fail("the cuda tests need an NVIDIA GPU (deselect them with -m 'not cuda')")
    device = torch.device("cuda")
    noise = keyed_gumbels(NoiseKey(5, 3), 2, 1000, device)
    assert noise.device.type == "cuda" and bool(noise.isfinite().all())
    assert torch.equal(noise, keyed_gumbels(NoiseKey(5, 3), 2, 1000, device))
    p = SamplingParams(temperature=1.0, seed=5)
    logits = torch.randn(1, 1000, device=device)
    token = sample(logits, SamplingTensors.build([p], [NoiseKey(5, 3)], 1000, device))
    assert token.device.type == "cuda"
    assert torch.equal(token, sample(logits, SamplingTensors.build([p], [NoiseKey(5, 3)], 1000, device)))
