"""Training in a reduced draft vocabulary: a complete one gives the full-vocabulary loss and
gradients, a reduced one trains without the drafter ever running the target's LM head, labels
outside it leave the CE term and are counted; and the vocabulary chosen from the training
responses, with its coverage."""

import copy
import os
from collections import Counter

import pytest
import torch

from dspark.models.drafter import Drafter
from dspark.models.loader import load_target
from dspark.train.data import EncodedPrompt, write_shard
from dspark.train.features import TargetFeatureExtractor
from dspark.train.forward import (DraftVocab, MetricPool, block_context, draft_rows,
                                  supervised_slots, training_forward)
from dspark.train.fused_loss import fused_dspark_loss
from dspark.train.loss import (LossWeights, build_block_batch, dspark_loss, per_position_mean,
                               position_weights)
from dspark.train.prune_vocab import (choose_vocab, coverage, coverage_note, data_counts,
                                      prune_drafter, response_token_counts)
from dspark.train.train_config import TrainConfig, build_drafter_config
from dspark.train.trainer import init_drafter
from train_helpers import VOCAB, tiny_target

GAMMA = 4
LAYERS = (0, 2)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(tiny_target(str(tmp_path_factory.mktemp("draft_vocab_target"))), torch.float32)


def make_drafter(target, head: str = "vanilla", lm_head=None) -> Drafter:
    cfg = TrainConfig(out_dir="", block_size=GAMMA, markov_rank=8, markov_head_type=head,
                      target_layer_ids=LAYERS, mask_token_id=1)
    drafter = Drafter(build_drafter_config(cfg, target.config), target.model.embed_tokens,
                      lm_head if lm_head is not None else target.model.lm_head)
    init_drafter(drafter, 0)
    with torch.no_grad():      # W2 starts at zero: give the Markov bias (and W1) a gradient
        drafter.markov_head.markov_w2.weight.normal_(0, 0.1)
    return drafter


def make_batch(seed: int = 0, num: int = 3):
    g = torch.Generator().manual_seed(seed)
    seqs, masks = [], []
    for _ in range(num):
        n, prompt = int(torch.randint(20, 30, (1,), generator=g)), int(torch.randint(3, 8, (1,), generator=g))
        seqs.append(torch.randint(3, VOCAB - 1, (n,), generator=g))
        masks.append(torch.arange(n) >= prompt)
    return build_block_batch(seqs, masks, GAMMA, 1, 6, torch.Generator().manual_seed(seed))


def extractor(target) -> TargetFeatureExtractor:
    return TargetFeatureExtractor(target.model, target.config, LAYERS)


def grads(drafter: Drafter) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_a_complete_draft_vocabulary_gives_the_full_vocabulary_loss_and_gradients(target, head):
    drafter, ext, batch = make_drafter(target, head), extractor(target), make_batch()
    calls = []
    hook = target.model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        full, m_full = training_forward(drafter, ext, batch, LossWeights(), autocast=False)
        full.total.backward()
        g_full, full_calls = grads(drafter), len(calls)
        identity = DraftVocab.build(target.model.lm_head.weight.detach(), torch.arange(VOCAB), VOCAB)
        drafted, m_drafted = training_forward(drafter, ext, batch, LossWeights(), False, vocab=identity)
        drafted.total.backward()
        g_drafted = grads(drafter)
    finally:
        hook.remove()
    # the target runs its LM head for the teacher either way; the full-vocabulary drafter once more
    assert full_calls == len(calls) - full_calls + 1
    for a, b in [(full.total, drafted.total), (full.ce, drafted.ce), (full.l1, drafted.l1),
                 (full.conf, drafted.conf), (full.accept, drafted.accept),
                 (m_full.accept, m_drafted.accept), (m_full.greedy_match, m_drafted.greedy_match),
                 (m_full.confidence, m_drafted.confidence)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert m_drafted.labels_outside == 0 and m_drafted.supervised_slots == m_full.supervised_slots
    assert g_full.keys() == g_drafted.keys() and "markov_head.markov_w1.weight" in g_full
    for name in g_full:
        torch.testing.assert_close(g_drafted[name], g_full[name], rtol=1e-4, atol=1e-6)


def test_a_reduced_vocabulary_trains_without_the_target_lm_head(target):
    """The drafter gets its own copy of the LM head, so any use of it would show: it is never
    run and its weight gets no gradient, while the loss falls over steps on one batch."""
    head = copy.deepcopy(target.model.lm_head).requires_grad_(True)
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    keep = torch.arange(0, VOCAB, 2)
    small = prune_drafter(make_drafter(target, lm_head=head), keep)
    assert small.config.draft_vocab_size == keep.numel() and small.lm_head is head
    ext, batch = extractor(target), make_batch(1)
    opt = torch.optim.AdamW([p for p in small.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        out, metrics = training_forward(small, ext, batch, LossWeights(), autocast=False)
        opt.zero_grad(set_to_none=True)
        out.total.backward()
        opt.step()
        losses.append(float(out.total.detach()))
    out, _ = training_forward(small, ext, batch, LossWeights(), autocast=True)     # as the trainer runs
    out.total.backward()
    assert torch.isfinite(out.total) and small.fc.weight.grad is not None
    assert not calls and head.weight.grad is None
    assert losses[-1] < 0.9 * losses[0] and all(map(torch.isfinite, torch.tensor(losses)))
    # the rows the loss saw are the inference API's draft-vocabulary logits
    sel = supervised_slots(batch)
    aux = ext(batch.tokens, batch.seq_offsets, sel.teacher_rows).aux_hidden
    with torch.no_grad():
        h_block = small.block_forward(batch.block_ids, batch.positions, *block_context(small, aux, batch))
        rows = draft_rows(small, h_block, batch, sel)
        h_sel = small.draft_hidden(h_block)[sel.blocks, sel.slots]
        e = small.markov_embed(batch.prev_ids[sel.blocks, sel.slots])
        logits = small.base_logits(h_sel) + small.markov_bias(e, h_sel, None)[0]
    assert rows.base.shape[-1] == keep.numel()
    torch.testing.assert_close(rows.corrected(), logits)


def test_labels_outside_the_draft_vocabulary_leave_the_ce_term_and_are_counted(target):
    ext, batch = extractor(target), make_batch(2)
    sel = supervised_slots(batch)
    feats = ext(batch.tokens, batch.seq_offsets, sel.teacher_rows)
    labels = batch.labels[sel.blocks, sel.slots]
    top = feats.teacher_logits.argmax(-1)[sel.teacher_index]
    # every other label and half the target's argmaxes inside
    keep = torch.unique(torch.cat([labels[::2], top[::2], torch.tensor([2])]))
    inside = torch.isin(labels, keep)
    assert 0 < int((~inside).sum()) < labels.numel()
    small = prune_drafter(make_drafter(target), keep)
    out, metrics = training_forward(small, ext, batch, LossWeights(), autocast=False)
    assert metrics.labels_outside == int((~inside).sum())
    pool = MetricPool(GAMMA)
    pool.add(out, metrics)
    pool.add(out, metrics)
    assert pool.summary()["labels_outside"] == 2 * metrics.labels_outside
    with torch.no_grad():      # by hand: the teacher renormalised over the kept ids
        ctx = block_context(small, feats.aux_hidden, batch)
        h_block = small.block_forward(batch.block_ids, batch.positions, *ctx)
        log_p = torch.log_softmax(draft_rows(small, h_block, batch, sel).corrected(), -1)
    teacher = torch.softmax(feats.teacher_logits[:, keep], -1)[sel.teacher_index]
    w = position_weights(GAMMA)[sel.slots]
    draft_label = torch.searchsorted(keep, labels).clamp(max=keep.numel() - 1)
    ce = -log_p.gather(1, draft_label[:, None]).squeeze(1)
    l1 = (log_p.exp() - teacher).abs().sum(-1)
    assert float(out.ce) == pytest.approx(float((ce * w)[inside].sum() / w[inside].sum()), rel=1e-5)
    assert float(out.l1) == pytest.approx(float((l1 * w).sum() / w.sum()), rel=1e-5)
    torch.testing.assert_close(out.accept, (1 - l1 / 2).clamp(0, 1), rtol=1e-5, atol=1e-6)
    # a target argmax outside the draft vocabulary is a greedy miss
    match = torch.isin(top, keep) & (keep[log_p.argmax(-1)] == top)
    grid = torch.zeros(batch.supervised.shape)
    grid[sel.blocks, sel.slots] = match.float()
    torch.testing.assert_close(metrics.greedy_match, per_position_mean(grid, batch.supervised))


def test_fused_loss_with_a_label_mask_matches_the_reference():
    g = torch.Generator().manual_seed(0)
    m, v, u = 10, 40, 4
    base = torch.randn(m, v, generator=g).requires_grad_(True)
    bias = torch.randn(m, v, generator=g).requires_grad_(True)
    teacher = torch.softmax(torch.randn(u, v, generator=g), -1)
    index = torch.randint(0, u, (m,), generator=g)
    labels = torch.randint(0, v, (m,), generator=g)
    conf = torch.randn(m, generator=g).requires_grad_(True)
    weights = position_weights(5)[torch.arange(m) % 5]
    mask = torch.arange(m) % 3 != 0
    out, _ = fused_dspark_loss(base, bias, teacher, index, labels, conf, weights,
                               torch.zeros(m, dtype=torch.long), label_mask=mask)
    out.total.backward()
    fused = [t.grad.clone() for t in (base, bias, conf)]
    for t in (base, bias, conf):
        t.grad = None
    ref = dspark_loss(base + bias, teacher[index], labels, conf, weights, label_mask=mask)
    ref.total.backward()
    for a, b in [(out.total, ref.total), (out.ce, ref.ce), (out.l1, ref.l1), (out.conf, ref.conf)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, t in zip(fused, (base, bias, conf)):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-6)
    # a masked row's label does not matter
    other = labels.clone()
    other[~mask] = (other[~mask] + 7) % v
    again, _ = fused_dspark_loss(base, bias, teacher, index, other, conf, weights,
                                 torch.zeros(m, dtype=torch.long), label_mask=mask)
    assert torch.equal(again.total, out.total)


# ---- the vocabulary from the training responses ---------------------------------------------------

def write_data(data_dir: str) -> tuple[list[list[int]], list[list[int]]]:
    """Two shards of random responses (every 4th held out, one of a single token); returns the
    train and held-out responses."""
    os.makedirs(data_dir)
    g = torch.Generator().manual_seed(5)
    train, held = [], []
    for shard in range(2):
        prompts, responses = [], []
        for i in range(12):
            heldout = i % 4 == 0
            n = 1 if (shard, i) == (1, 5) else int(torch.randint(5, 40, (1,), generator=g))
            # a skewed distribution: low ids much more often
            resp = (torch.rand(n, generator=g) ** 3 * (VOCAB - 3)).long().add(3).tolist()
            prompts.append(EncodedPrompt(f"s{shard}p{i}", f"g{i}", "chat", heldout,
                                         torch.randint(3, VOCAB, (6,), generator=g).tolist()))
            responses.append(resp)
            (held if heldout else train).append(resp)
        write_shard(os.path.join(data_dir, f"shard_{shard:05d}.pt"), prompts, responses,
                    ["length"] * len(prompts))
    return train, held


def test_vocabulary_from_the_training_responses_and_its_coverage(tmp_path):
    data_dir = str(tmp_path / "data")
    train, held = write_data(data_dir)
    counts, n = response_token_counts(data_dir, heldout=False)
    assert n == len(train) and counts == Counter(t for r in train for t in r)
    both = data_counts(data_dir)
    assert both.train == counts and both.heldout == Counter(t for r in held for t in r)
    keep = choose_vocab(both.train, 20, VOCAB, always=[2])
    shuffled = Counter(dict(sorted(both.train.items(), key=lambda kv: -kv[0])))
    assert torch.equal(keep, choose_vocab(shuffled, 20, VOCAB, always=[2]))
    assert torch.equal(keep, choose_vocab(data_counts(data_dir).train, 20, VOCAB, always=[2]))
    more_train, _ = write_data(str(tmp_path / "more"))           # a second folder counts too
    joined = data_counts(data_dir, (str(tmp_path / "more"),))
    assert joined.train == counts + Counter(t for r in more_train for t in r)
    assert joined.heldout == both.heldout and "`" + str(tmp_path / "more") + "`" in joined.train_source
    kept = set(keep.tolist())
    by_hand = {name: sum(t in kept for r in rs for t in r) / sum(len(r) for r in rs)
               for name, rs in (("train", train), ("held", held))}
    assert 0 < by_hand["held"] < 1 and 0 < by_hand["train"] < 1
    assert coverage(both.train, keep) == pytest.approx(by_hand["train"])
    assert coverage(both.heldout, keep) == pytest.approx(by_hand["held"])
    note = coverage_note(both, keep, VOCAB, "dspark prune-vocab --size 20 --data-dir x")
    assert f"{by_hand['train']:.1%}" in note and f"{by_hand['held']:.1%}" in note
    assert f"the {len(train)} training responses" in note and f"{len(held)} held-out responses" in note


def test_prune_vocab_from_the_training_data_writes_the_coverage_in_the_card(tmp_path, caplog):
    import types

    from dspark.models.drafter_loader import read_drafter_config
    from dspark.train.prune_vocab import run_prune
    from tiny import save_random_drafter
    target_dir = tiny_target(str(tmp_path / "target"))
    drafter_dir = str(tmp_path / "drafter")
    save_random_drafter(drafter_dir, target_dir)
    data_dir = str(tmp_path / "data")
    train, held = write_data(data_dir)
    args = types.SimpleNamespace(drafter=drafter_dir, model=target_dir, dtype="float32", threads=1,
                                 max_num_seqs=4, out=str(tmp_path / "small"), size=24,
                                 data_dir=data_dir, num_prompts=0, max_tokens=0, seed=0)
    with caplog.at_level("INFO", logger="dspark.train.prune_vocab"):
        run_prune(args)
    counts = data_counts(data_dir)
    keep = choose_vocab(counts.train, 24, VOCAB, always=[2])
    assert read_drafter_config(args.out)["draft_vocab_size"] == 24
    card = open(os.path.join(args.out, "README.md")).read()
    assert coverage_note(counts, keep, VOCAB, f"dspark prune-vocab --size 24 --data-dir {data_dir}") in card
    assert f"{100 * coverage(counts.heldout, keep):.2f}% on the {len(held)} held-out" in caplog.text


def test_ce_on_the_target_argmax_takes_the_teacher_s_top_token_as_the_label(target):
    """`ce_labels="argmax"` is the CE a batch whose labels were the target's argmax would give;
    the L1 and confidence terms, which never read the label, are unchanged."""
    import dataclasses
    drafter, ext, batch = make_drafter(target), extractor(target), make_batch(seed=3)
    sel = supervised_slots(batch)
    with torch.no_grad():
        feats = ext(batch.tokens, batch.seq_offsets, sel.teacher_rows, None)
        argmax_labels = batch.labels.clone()
        argmax_labels[sel.blocks, sel.slots] = feats.teacher_logits.argmax(-1)[sel.teacher_index]
        assert not torch.equal(argmax_labels, batch.labels)
        sampled, _ = training_forward(drafter, ext, batch, LossWeights(), autocast=False)
        argmax, _ = training_forward(drafter, ext, batch, LossWeights(ce_labels="argmax"), autocast=False)
        relabelled, _ = training_forward(drafter, ext, dataclasses.replace(batch, labels=argmax_labels),
                                         LossWeights(), autocast=False)
    torch.testing.assert_close(argmax.ce, relabelled.ce)
    assert not torch.allclose(argmax.ce, sampled.ce)
    torch.testing.assert_close(argmax.l1, sampled.l1)
    with pytest.raises(ValueError, match="ce_labels"):
        LossWeights(ce_labels="greedy")
