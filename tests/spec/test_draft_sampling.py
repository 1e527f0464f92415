"""The sampled Markov loop draws its noise for the whole block at once and only over the draft
vocabulary, yet a seeded request's drafts and q are bit for bit what a race over the target
vocabulary on each position's own noise gives (the reference below: the noise its target rows
race on in verification); greedy rows in the same batch keep their argmax."""

import pytest
import torch

from dspark.models.drafter_loader import load_drafter
from dspark.models.loader import load_target
from dspark.sampling_params import SamplingParams
from dspark.spec.draft import _markov_loop
from dspark.spec.sampler import NoiseKey, SamplingTensors, _mix, seeded_exponentials
from dspark.train.prune_vocab import prune_drafter
from tiny import save_random_drafter, save_tiny

VOCAB = 48


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    target_dir = str(tmp_path_factory.mktemp("target"))
    save_tiny(target_dir, "llama", tied=True, vocab=VOCAB, num_hidden_layers=4, seed=4)
    drafter_dir = str(tmp_path_factory.mktemp("drafter"))
    save_random_drafter(drafter_dir, target_dir, gamma=5, rank=8, std=0.3)
    target = load_target(target_dir, torch.float32)
    full = load_drafter(drafter_dir, target.config, target.model.embed_tokens, target.model.lm_head,
                        torch.float32)
    return {"full vocabulary": full, "draft vocabulary": prune_drafter(full, torch.arange(1, VOCAB, 3))}


def reference_loop(drafter, h, base, anchors, state, st):
    """Per position, q over the target vocabulary and the race on that position's Exp(1) noise of
    V values, drawn from a generator seeded by (seed, position) alone."""
    tokens, probs, prev = [], [], anchors
    for k in range(h.shape[1]):
        e = drafter.markov_embed(prev)
        bias, state = drafter.markov_bias(e, h[:, k], state)
        logits = drafter.scatter_to_target_vocab(base[:, k] + bias.float())
        q = torch.softmax(logits / st.temperature[:, None], dim=-1)
        gens = [torch.Generator().manual_seed(_mix(key.seed, key.position + k)) for key in st.keys]
        noise = torch.stack([torch.empty(q.shape[1]).exponential_(generator=g) for g in gens])
        prev = torch.where(st.greedy, logits.argmax(-1), (q / noise).argmax(-1))
        tokens.append(prev)
        probs.append(q)
    return torch.stack(tokens, 1), torch.stack(probs, 1)


@pytest.mark.parametrize("vocab", ["full vocabulary", "draft vocabulary"])
def test_seeded_drafts_race_on_their_positions_noise(drafters, vocab):
    drafter = drafters[vocab]
    r, gamma = 4, drafter.config.block_size
    torch.manual_seed(0)
    h = torch.randn(r, gamma, drafter.config.hidden_size)
    base = drafter.base_logits(h).float()
    anchors = torch.tensor([3, 7, 11, 19])
    params = [SamplingParams(temperature=t, seed=s) for t, s in [(0.7, 1), (1.3, 2), (0.0, 3), (0.2, 4)]]

    def tensors() -> SamplingTensors:
        keys = [NoiseKey(p.seed, 30 + i) for i, p in enumerate(params)]
        return SamplingTensors.build(params, keys, VOCAB, torch.device("cpu"))

    new_st, ref_st = tensors(), tensors()
    with torch.no_grad():
        got = _markov_loop(drafter, h, base, anchors, None, new_st)
        want_tokens, want_q = reference_loop(drafter, h, base, anchors, None, ref_st)
    assert torch.equal(got.tokens, want_tokens)
    assert torch.equal(got.probs, want_q)
    assert (got.tokens[:, :] >= 0).all() and len({tuple(t) for t in got.tokens.tolist()}) > 1


def test_seeded_exponentials_equal_torch_exponential():
    for seed, size, count in [(0, 1, 1), (5, 49153, 3), (2 ** 40 + 7, 1000, 7)]:
        a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = torch.stack([torch.empty(size).exponential_(generator=a) for _ in range(count)])
        assert torch.equal(seeded_exponentials(b, count, size, torch.device("cpu")), want)
        cols = torch.tensor([0, size // 2, size - 1])
        c = torch.Generator().manual_seed(seed)
        assert torch.equal(seeded_exponentials(c, count, size, torch.device("cpu"), cols), want[:, cols])
