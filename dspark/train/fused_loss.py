"""The CE + L1 part of the DSpark loss, fused and chunked over rows of the vocabulary axis.

With plain autograd, each [M, V] intermediate (fp32 logits, log-softmax, probabilities, the
difference with the teacher, its absolute value, and their gradients) is a separate pass over
M·V·4 bytes (~180 MB for M = 900 rows of V = 49152), and those passes cost more than the LM-head
matmul itself on a CPU. Here a few rows at a time (a chunk fits in L2) are turned into
probabilities, compared with the teacher and reduced, and the backward recomputes them from the
saved log-normaliser instead of keeping any vocabulary-sized activation:

    d CE / d x_j  = p_j - [j = label]
    d L1 / d x_j  = p_j (s_j - Σ_v p_v s_v),   s = sign(p - q)

`loss.dspark_loss` is the plain reference; tests check that both give the same values and
gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.train.loss import LossOutput, LossWeights, acceptance_target, weighted_mean


@dataclass
class FusedTerms:
    weighted: torch.Tensor       # scalar Σ_m (w_ce[m] CE[m] + w_l1[m] L1[m]), differentiable
    ce: torch.Tensor             # [M] per-row cross-entropy (detached)
    l1: torch.Tensor             # [M] per-row ||p_d - p_t||_1 (detached)
    top_match: torch.Tensor      # [M] bool: the target's argmax token is also the draft's


def _logits(base: torch.Tensor, bias: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    x = base[lo:hi].to(torch.float32, copy=True)      # a fresh chunk: the ops below are in place
    return x if bias is None else x.add_(bias[lo:hi])


class _FusedCeL1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base, bias, teacher, teacher_index, labels, w_ce, w_l1, target_top, chunk):
        m = base.shape[0]
        lse = base.new_empty(m, dtype=torch.float32)
        ce, l1 = torch.empty_like(lse), torch.empty_like(lse)
        match = torch.empty(m, dtype=torch.bool, device=base.device)
        for lo in range(0, m, chunk):
            hi = min(m, lo + chunk)
            x = _logits(base, bias, lo, hi)                                    # [c, V] fp32
            # argmax is much slower than amax on CPU (docs/measurements.md): compare the max with
            # the target's top token
            match[lo:hi] = x.gather(1, target_top[lo:hi, None]).squeeze(1) >= x.amax(-1)
            lse[lo:hi] = torch.logsumexp(x, -1)
            ce[lo:hi] = lse[lo:hi] - x.gather(1, labels[lo:hi, None]).squeeze(1)
            p = x.sub_(lse[lo:hi, None]).exp_()
            l1[lo:hi] = p.sub_(teacher.index_select(0, teacher_index[lo:hi])).abs_().sum(-1)
        ctx.save_for_backward(base, bias, teacher, teacher_index, labels, w_ce, w_l1, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(ce, l1, match)
        return (w_ce * ce + w_l1 * l1).sum(), ce, l1, match

    @staticmethod
    def backward(ctx, grad_out, _ce, _l1, _match):
        base, bias, teacher, teacher_index, labels, w_ce, w_l1, lse = ctx.saved_tensors
        grad_base = torch.empty_like(base)
        grad_bias = None if bias is None else torch.empty_like(bias)
        for lo in range(0, base.shape[0], ctx.chunk):
            hi = min(base.shape[0], lo + ctx.chunk)
            p = _logits(base, bias, lo, hi).sub_(lse[lo:hi, None]).exp_()     # [c, V]
            s = teacher.index_select(0, teacher_index[lo:hi]).sub_(p).neg_().sign_()
            ps = (p * s).sum(-1, keepdim=True)
            g = s.sub_(ps).mul_(w_l1[lo:hi, None]).add_(w_ce[lo:hi, None]).mul_(p)
            rows = torch.arange(hi - lo, device=g.device)
            g[rows, labels[lo:hi]] -= w_ce[lo:hi]
            g.mul_(grad_out)
            grad_base[lo:hi] = g
            if grad_bias is not None:
                grad_bias[lo:hi] = g
        return grad_base, grad_bias, None, None, None, None, None, None, None


def fused_ce_l1(base: torch.Tensor, bias: torch.Tensor | None, teacher: torch.Tensor,
                teacher_index: torch.Tensor, labels: torch.Tensor, w_ce: torch.Tensor,
                w_l1: torch.Tensor, target_top: torch.Tensor, chunk: int = 4) -> FusedTerms:
    """Corrected logits = base + bias ([M, V], any float dtype); teacher [U, V] probabilities with
    teacher_index [M] picking each row's; w_ce/w_l1 [M] the final per-row coefficients;
    target_top [M] the target's argmax token of each row (for the greedy-match metric)."""
    weighted, ce, l1, match = _FusedCeL1.apply(base, bias, teacher, teacher_index, labels,
                                               w_ce.float(), w_l1.float(), target_top, chunk)
    return FusedTerms(weighted, ce, l1, match)


def fused_dspark_loss(base: torch.Tensor, bias: torch.Tensor | None, teacher: torch.Tensor,
                      teacher_index: torch.Tensor, labels: torch.Tensor,
                      conf_logits: torch.Tensor | None, weights: torch.Tensor,
                      target_top: torch.Tensor, alphas: LossWeights = LossWeights(),
                      chunk: int = 4,
                      label_mask: torch.Tensor | None = None) -> tuple[LossOutput, torch.Tensor]:
    """`loss.dspark_loss` on the fused kernel; also returns the top-1 match [M] for metrics.
    `label_mask` [M] (bool) keeps a row in the CE term; unset, every row is."""
    norm = weights.sum().clamp_min(1e-12)
    ce_weights, ce_norm = weights, norm
    if label_mask is not None:
        ce_weights = weights * label_mask
        ce_norm = ce_weights.sum().clamp_min(1e-12)
    terms = fused_ce_l1(base, bias, teacher, teacher_index, labels,
                        alphas.ce * ce_weights / ce_norm, alphas.l1 * weights / norm, target_top,
                        chunk)
    accept = acceptance_target(terms.l1)
    total = terms.weighted
    conf_mean = torch.zeros((), device=base.device)
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), accept, reduction="none")
        conf_mean = weighted_mean(bce, weights)
        total = total + alphas.conf * conf_mean
    out = LossOutput(total=total, ce=weighted_mean(terms.ce, ce_weights),
                     l1=weighted_mean(terms.l1, weights), conf=conf_mean.detach(), accept=accept)
    return out, terms.top_match
