"""Anchor sampling, supervision masks, block inputs and each loss term on hand-computed cases."""

import math

import pytest
import torch

from dspark.train.loss import (LossWeights, acceptance_target, block_inputs, build_block_batch,
                               dspark_loss, expected_accept_length, l1_distance, per_position_mean,
                               position_weights, sample_anchor_positions, supervision_mask,
                               valid_anchor_positions, weighted_mean)


def mask(bits: str) -> torch.Tensor:
    return torch.tensor([b == "1" for b in bits])


def test_valid_anchors_need_anchor_and_first_label_in_the_response():
    assert valid_anchor_positions(mask("00111011")).tolist() == [2, 3, 6]
    assert valid_anchor_positions(mask("0001")).tolist() == []       # last token has no label


def test_sample_anchor_positions_distinct_sorted_valid_and_seeded():
    m = mask("0" * 5 + "1" * 40)
    valid = set(valid_anchor_positions(m).tolist())
    a = sample_anchor_positions(m, 10, torch.Generator().manual_seed(3))
    b = sample_anchor_positions(m, 10, torch.Generator().manual_seed(3))
    assert a.tolist() == b.tolist() == sorted(set(a.tolist()))
    assert len(a) == 10 and set(a.tolist()) <= valid
    # fewer valid anchors than asked: all of them
    assert sample_anchor_positions(mask("0111"), 10).tolist() == [1, 2]


def test_supervision_mask_is_the_contiguous_valid_label_prefix():
    m = mask("00111101")                                   # S = 8, hole at 6
    sup = supervision_mask(torch.tensor([2, 4, 5]), m, 3)
    assert sup.tolist() == [[True, True, True],            # labels at 3, 4, 5
                            [True, False, False],          # 5 ok, 6 masked -> 7 is cut too
                            [False, False, False]]         # label at 6 is a prompt token
    end = supervision_mask(torch.tensor([4]), mask("111111"), 3)
    assert end.tolist() == [[True, False, False]]           # labels 6, 7 are past the end


def test_block_inputs_layout_and_teacher_alignment():
    tokens = torch.arange(10, 18)
    ids, pos, labels, prev = block_inputs(tokens, torch.tensor([2, 6]), 3, mask_token_id=99)
    assert ids.tolist() == [[12, 99, 99], [16, 99, 99]]
    assert pos.tolist() == [[2, 3, 4], [6, 7, 8]]           # anchor_pos + k
    assert labels.tolist()[0] == [13, 14, 15]               # y_{a+k+1}
    assert prev.tolist()[0] == [12, 13, 14]                 # y_{a+k}: [anchor, y_1, y_2]
    assert labels.tolist()[1][0] == 17                      # later slots are clamped (masked out)


def test_block_batch_offsets_rows_and_labels():
    seqs = [torch.arange(100, 108), torch.arange(200, 206)]
    masks = [mask("00011111"), mask("011111")]
    batch = build_block_batch(seqs, masks, 3, 99, anchors_per_seq=10)
    assert batch.seq_offsets.tolist() == [0, 8, 14]
    assert batch.seq_index.tolist() == [0] * 4 + [1] * 4
    assert batch.anchor_pos.tolist() == [3, 4, 5, 6, 1, 2, 3, 4]
    # the teacher row of slot k is position a+k: the target's prediction of label y_{a+k+1}
    for n, k in batch.supervised.nonzero().tolist():
        row = int(batch.teacher_rows[n, k])
        assert batch.tokens[row + 1] == batch.labels[n, k]
        assert batch.tokens[row] == batch.prev_ids[n, k]
        assert row - batch.seq_offsets[batch.seq_index[n]] == batch.anchor_pos[n] + k
    assert batch.supervised.sum(1).tolist() == [3, 3, 2, 1, 3, 3, 2, 1]


def test_position_weights_use_the_0_based_slot_and_decay_4():
    w = position_weights(7, 4.0)
    assert w[0] == 1.0
    assert torch.allclose(w, torch.tensor([math.exp(-k / 4) for k in range(7)]))
    assert round(float(w[1]), 3) == 0.779 and round(float(w[6]), 3) == 0.223


def test_l1_and_acceptance_target():
    p = torch.tensor([[0.5, 0.5, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.5]])
    assert torch.allclose(l1_distance(p, q), torch.tensor([1.0]))
    assert torch.allclose(acceptance_target(l1_distance(p, q)), torch.tensor([0.5]))
    # 1 - ½ L1 is Σ min(p, q), the exact acceptance rate of speculative sampling
    g = torch.Generator().manual_seed(0)
    a = torch.softmax(torch.randn(5, 11, generator=g), -1)
    b = torch.softmax(torch.randn(5, 11, generator=g), -1)
    assert torch.allclose(acceptance_target(l1_distance(a, b)), torch.minimum(a, b).sum(-1), atol=1e-6)
    assert acceptance_target(torch.tensor([2.5])).item() == 0.0          # clamped
    assert not acceptance_target(torch.tensor([1.0], requires_grad=True)).requires_grad


def test_weighted_mean():
    assert weighted_mean(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, 1.0])).item() == 2.0


def hand_case():
    """Two supervised slots, V = 3, every quantity by hand."""
    logits = torch.log(torch.tensor([[1.0, 1.0, 1.0], [1.0, 3.0, 4.0]]))   # p = 1/3s; 1/8, 3/8, 1/2
    teacher = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])
    labels = torch.tensor([0, 2])
    conf = torch.tensor([0.0, math.log(3.0)])                              # sigmoid: 1/2, 3/4
    weights = torch.tensor([1.0, math.exp(-0.25)])
    ce = [math.log(3), math.log(2)]
    l1 = [2 / 3, 1 / 4]
    c = [2 / 3, 7 / 8]
    bce = [math.log(2), -(7 / 8 * math.log(3 / 4) + 1 / 8 * math.log(1 / 4))]
    return logits, teacher, labels, conf, weights, ce, l1, c, bce


def test_dspark_loss_matches_the_hand_computed_terms():
    logits, teacher, labels, conf, weights, ce, l1, c, bce = hand_case()
    out = dspark_loss(logits, teacher, labels, conf, weights)
    w = weights.tolist()
    mean = lambda v: (v[0] * w[0] + v[1] * w[1]) / (w[0] + w[1])   # noqa: E731
    assert out.ce.item() == pytest.approx(mean(ce), rel=1e-5)
    assert out.l1.item() == pytest.approx(mean(l1), rel=1e-5)
    assert out.conf.item() == pytest.approx(mean(bce), rel=1e-5)
    assert out.accept.tolist() == pytest.approx(c, rel=1e-5)
    total = 0.1 * mean(ce) + 0.9 * mean(l1) + 1.0 * mean(bce)
    assert out.total.item() == pytest.approx(total, rel=1e-5)
    no_conf = dspark_loss(logits, teacher, labels, None, weights)
    assert no_conf.total.item() == pytest.approx(0.1 * mean(ce) + 0.9 * mean(l1), rel=1e-5)


def test_confidence_target_is_detached_from_the_draft_distribution():
    logits, teacher, labels, conf, weights, *_ = hand_case()
    logits = logits.clone().requires_grad_(True)
    conf = conf.clone().requires_grad_(True)
    alphas = LossWeights(ce=0.0, l1=0.0, conf=1.0)
    dspark_loss(logits, teacher, labels, conf, weights, alphas).total.backward()
    assert logits.grad is None or not logits.grad.any()
    assert conf.grad.abs().sum() > 0


def test_l1_gradient_moves_the_draft_toward_the_teacher():
    teacher = torch.tensor([[0.7, 0.2, 0.1]])
    logits = torch.zeros(1, 3, requires_grad=True)
    alphas = LossWeights(ce=0, l1=1, conf=0)
    out = dspark_loss(logits, teacher, torch.tensor([0]), None, torch.ones(1), alphas)
    out.total.backward()
    assert logits.grad[0, 0] < 0 < logits.grad[0, 2]


def test_per_position_rates_and_tau():
    values = torch.tensor([[1.0, 0.5], [0.0, 9.0]])
    sup = torch.tensor([[True, True], [True, False]])
    assert per_position_mean(values, sup).tolist() == [0.5, 0.5]
    assert expected_accept_length(torch.tensor([0.5, 0.5])).item() == pytest.approx(1.75)
    assert expected_accept_length(torch.tensor([1.0, 1.0, 1.0])).item() == pytest.approx(4.0)


@pytest.mark.parametrize("with_bias,dtype", [(True, torch.float32), (False, torch.float32),
                                             (True, torch.bfloat16)])
def test_fused_loss_matches_the_reference_values_and_gradients(with_bias, dtype):
    from dspark.train.fused_loss import fused_dspark_loss
    g = torch.Generator().manual_seed(0)
    m, v, u = 9, 50, 5
    base = (torch.randn(m, v, generator=g) * 2).to(dtype).requires_grad_(True)
    bias = torch.randn(m, v, generator=g).requires_grad_(True) if with_bias else None
    teacher = torch.softmax(torch.randn(u, v, generator=g) * 2, -1)
    index = torch.randint(0, u, (m,), generator=g)
    labels = torch.randint(0, v, (m,), generator=g)
    conf = torch.randn(m, generator=g, requires_grad=True)
    weights = position_weights(3)[torch.arange(m) % 3]

    top = torch.randint(0, v, (m,), generator=g)
    logits = base.detach().float() + (bias.detach() if with_bias else 0)
    top[::2] = logits[::2].argmax(-1)                      # half the rows match
    out, match = fused_dspark_loss(base, bias, teacher, index, labels, conf, weights, top, chunk=4)
    out.total.backward()
    grads = [base.grad.clone(), conf.grad.clone()] + ([bias.grad.clone()] if with_bias else [])
    for t in [base, conf] + ([bias] if with_bias else []):
        t.grad = None
    logits = base.float() + (bias if with_bias else 0)
    ref = dspark_loss(logits, teacher[index], labels, conf, weights)
    ref.total.backward()
    ref_grads = [base.grad, conf.grad] + ([bias.grad] if with_bias else [])
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    for a, b in [(out.total, ref.total), (out.ce, ref.ce), (out.l1, ref.l1), (out.conf, ref.conf),
                 (out.accept, ref.accept)]:
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a.float(), b.float(), **tol)
    assert torch.equal(match, logits.argmax(-1) == top) and match[::2].all()
