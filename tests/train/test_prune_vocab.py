"""Reduced draft vocabulary from a trained drafter: the kept rows are the original's, drafts stay
inside the kept ids, the result saves and loads, and decoding with it stays lossless."""

from collections import Counter

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.models.drafter_loader import load_drafter
from dspark.models.loader import load_target
from dspark.train.export import save_speculators
from dspark.train.prune_vocab import choose_vocab, coverage, prune_drafter
from tiny import save_random_drafter, save_tiny, scatter_to_target_vocab

VOCAB = 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = str(tmp_path_factory.mktemp("prune_target"))
    save_tiny(target, "llama", tied=True, vocab=VOCAB, num_hidden_layers=4, seed=4)
    drafter = str(tmp_path_factory.mktemp("prune_drafter"))
    save_random_drafter(drafter, target, gamma=4, copy_prev=9.0)
    return target, drafter


def test_choose_vocab_keeps_the_always_ids_then_the_most_used_then_the_lowest():
    counts = Counter({9: 5, 4: 7, 20: 5, 30: 1})
    assert choose_vocab(counts, 3, 32, always=[2]).tolist() == [2, 4, 9]        # 9 beats 20 on the id
    assert choose_vocab(counts, 7, 32, always=[2]).tolist() == [0, 1, 2, 4, 9, 20, 30]
    assert coverage(counts, torch.tensor([4, 9])) == pytest.approx(12 / 18)
    with pytest.raises(ValueError, match="must be in"):
        choose_vocab(counts, 33, 32, always=[])


def test_pruned_rows_equal_the_original_and_drafts_stay_inside(pair, tmp_path):
    target_dir, drafter_dir = pair
    target = load_target(target_dir, torch.float32)
    full = load_drafter(drafter_dir, target.config, target.model.embed_tokens, target.model.lm_head,
                        torch.float32)
    keep = torch.tensor([2, 3, 5, 8, 13, 21, 30])
    small = prune_drafter(full, keep)
    h = torch.randn(3, full.config.hidden_size)
    torch.testing.assert_close(small.base_logits(h), full.base_logits(h)[:, keep])
    e = full.markov_embed(torch.tensor([4, 5, 6]))
    torch.testing.assert_close(small.markov_bias(e, h, None)[0], full.markov_bias(e, h, None)[0][:, keep])
    scattered = scatter_to_target_vocab(small, small.base_logits(h))
    assert torch.isinf(scattered[:, [0, 1, 4]]).all() and scattered.argmax(-1).tolist() == \
        keep[small.base_logits(h).argmax(-1)].tolist()
    tied = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0], [0.5] * 7])   # ties take the first id
    assert small.to_target_ids(tied.argmax(-1)).tolist() == \
        scatter_to_target_vocab(small, tied).argmax(-1).tolist() == [5, 2]
    save_speculators(small, str(tmp_path))
    again = load_drafter(str(tmp_path), target.config, target.model.embed_tokens, target.model.lm_head,
                         torch.float32)
    assert again.config.draft_vocab_size == 7
    torch.testing.assert_close(again.base_logits(h), small.base_logits(h))
    with pytest.raises(ValueError, match="already has a reduced vocabulary"):
        prune_drafter(small, keep)


def test_decoding_with_a_pruned_drafter_is_lossless(pair, tmp_path):
    target_dir, drafter_dir = pair
    target = load_target(target_dir, torch.float32)
    full = load_drafter(drafter_dir, target.config, target.model.embed_tokens, target.model.lm_head,
                        torch.float32)
    save_speculators(prune_drafter(full, torch.arange(0, VOCAB, 2)), str(tmp_path))
    prompts = [[3, 5, 7, 9], [11, 4, 6], [20, 21, 22, 23, 24]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target_dir, dtype="float32", drafter=None, graph="eager").generate(prompts, params)
    llm = LLM(target_dir, dtype="float32", drafter=str(tmp_path), graph="eager")
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.spec_stats.draft_rounds > 0
