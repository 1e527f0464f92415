"""markov_greedy_bf16 (a drafter's vanilla Markov head at temperature 0, all γ drafts in one call)
against the same loop in torch."""

import pytest
import torch

from kernel_inputs import BF16, markov_args


def markov_reference(base, h, anchors, w1, w2, conf_w, conf_b, to_target):
    """Draft k: argmax of U_k + W2 W1[x_{k-1}] (the product rounded to bf16, as the projection
    returns it), mapped to a target id, which feeds draft k + 1; the confidence logit from
    [h_k ; W1[x_{k-1}]]."""
    rows, gamma = base.shape[:2]
    prev, tokens, conf = anchors.clone(), torch.empty(rows, gamma, dtype=torch.long), torch.zeros(rows, gamma)
    for k in range(gamma):
        e = w1[prev]
        best = (base[:, k] + (e.float() @ w2.float().t()).to(BF16).float()).argmax(-1)
        if conf_w is not None:
            feats = torch.cat([h[:, k], e], -1).float()
            conf[:, k] = (feats @ conf_w.float().t() + conf_b.float()).to(BF16).float()[:, 0]
        prev = best if to_target is None else to_target[best]
        tokens[:, k] = prev
    return tokens, conf


@pytest.mark.parametrize("conf,mapped", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_markov_greedy_matches_the_torch_loop(amx, conf, mapped, rows):
    args, (w2, conf_w) = markov_args(amx, conf=conf, mapped=mapped, rows=rows)
    base, h, anchors, w1, _, _, conf_b, to_target, _ = args
    tokens, logits = torch.ops.dspark_cpu.markov_greedy_bf16(*args)
    ref_tokens, ref_logits = markov_reference(base, h, anchors, w1, w2, conf_w if conf else None, conf_b, to_target)
    assert torch.equal(tokens, ref_tokens)
    assert logits.dtype == torch.float32 and torch.allclose(logits, ref_logits, rtol=2 ** -7, atol=1e-2)
    if not conf:
        assert not logits.any()
