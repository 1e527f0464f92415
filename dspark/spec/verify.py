"""Acceptance: greedy exact match, lossless rejection sampling against the draft's q, or for
seeded requests the same race on shared noise.

At temperature > 0 draft x_j is accepted with probability min(1, p_{j-1}(x_j) / q_j(x_j)); at the
first rejection the next token is drawn from the residual max(p - q, 0), and when every verified
draft passes a bonus token is drawn from p. A seeded request accepts a draft when it is the token
the target draws with that position's own noise (sampler.NoiseKey), which its drafter raced on,
then takes the target's draw after the accepted prefix: its text is plain decoding's with the
seed, whatever was verified (docs/speculation.md). Trimmed drafts (j > ℓ) are not verified.
Nothing waits for the host until the step's single copy.
"""

from __future__ import annotations

import torch

from dspark.kernels.cpu import greedy_tokens
from dspark.spec.sampler import SamplingTensors, global_exponentials, keyed_gumbels, processed_logits
from dspark.spec.types import DraftProposal, VerifyResult


def accept(target_logits: torch.Tensor, verify_lens: torch.Tensor, draft: DraftProposal,
           st: SamplingTensors) -> VerifyResult:
    """target_logits [R, γ+1, V] (row j predicts the token after x_j, x_0 the anchor). Every
    position's ratio test runs in one pass over [R, γ], the recovery distribution is built for
    the row after the accepted prefix alone, and the target's argmax is taken only when some
    row is greedy."""
    if st.all_greedy:
        return accept_greedy(target_logits.argmax(-1), verify_lens, draft)
    r, g1, _ = target_logits.shape
    gamma = g1 - 1
    seeded = [i for i, key in enumerate(st.keys) if key is not None and not st.greedy_host[i]]
    if draft.probs is None:          # every sampled row seeded (draft.py raced them): no q, no ratio test
        if len(seeded) == r:
            return accept_greedy(_seeded_draws(_target_scores(target_logits, st), st), verify_lens, draft)
        choice = target_logits.argmax(-1)                                       # [R, γ+1]
        sub = st.select(seeded)
        choice[seeded] = _seeded_draws(_target_scores(target_logits[seeded], sub), sub)
        return accept_greedy(choice, verify_lens, draft)
    scores = _target_scores(target_logits, st)                                 # [R, γ+1, V]
    p = torch.softmax(scores, dim=-1)
    p_x = p[:, :gamma].gather(-1, draft.tokens[..., None]).squeeze(-1)         # [R, γ]
    q_x = draft.probs.gather(-1, draft.tokens[..., None]).squeeze(-1)          # [R, γ]
    ok = torch.rand((r, gamma), device=target_logits.device) * q_x <= p_x
    target_argmax = target_logits.argmax(-1) if any(st.greedy_host) else None  # [R, γ+1]
    if target_argmax is not None:
        ok = torch.where(st.greedy[:, None], draft.tokens == target_argmax[:, :gamma], ok)
    drawn = _seeded_draws(scores[seeded], st.select(seeded)) if seeded else None       # [S, γ+1]
    if drawn is not None:
        ok[seeded] = draft.tokens[seeded] == drawn[:, :gamma]
    num_accepted = _accepted_prefix(ok, verify_lens)
    next_token = _recover_or_bonus(p, draft.probs, num_accepted, verify_lens)      # [R]
    if target_argmax is not None:
        greedy_next = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)
        next_token = torch.where(st.greedy, greedy_next, next_token)
    if drawn is not None:
        next_token[seeded] = drawn.gather(1, num_accepted[seeded][:, None]).squeeze(1)
    return _result(draft, num_accepted, next_token)


def _seeded_draws(scores: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """scores [S, γ+1, V] of seeded rows -> [S, γ+1] the token each position draws with its own
    noise, as a plain step sampling that position would (sampler.sample)."""
    s, g1, v = scores.shape
    noise = keyed_gumbels(st.keys[0], g1, v, scores.device) if s == 1 else \
        torch.cat([keyed_gumbels(key, g1, v, scores.device) for key in st.keys])         # [S·(γ+1), V]
    return greedy_tokens(noise.add_(scores.view(s * g1, v))).view(s, g1)


def _target_scores(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[R, γ+1, V] -> the target's processed logits. With temperature alone (the usual sampled
    request) each block is divided by its request's temperature directly, the bits
    `processed_logits` gives on the rows repeated per position, without repeating anything."""
    if st.top_k is None and st.top_p is None and st.min_p is None:
        return logits / st.temperature[:, None, None]
    r, g1, v = logits.shape
    return processed_logits(logits.reshape(r * g1, v), st.repeat(g1)).view(r, g1, v)


def accept_greedy(target_argmax: torch.Tensor, verify_lens: torch.Tensor,
                  draft: DraftProposal) -> VerifyResult:
    """target_argmax [R, γ+1]: greedy acceptance needs only the target's argmax per row, so a
    greedy batch never gathers its [R, γ+1, V] logits."""
    gamma = target_argmax.shape[1] - 1
    num_accepted = _accepted_prefix(draft.tokens == target_argmax[:, :gamma], verify_lens)
    return _result(draft, num_accepted, target_argmax.gather(1, num_accepted[:, None]).squeeze(1))


def _accepted_prefix(ok: torch.Tensor, verify_lens: torch.Tensor) -> torch.Tensor:
    """ok [R, γ] -> [R] length of the leading run of accepted, verified drafts."""
    in_range = torch.arange(ok.shape[1], device=ok.device)[None, :] < verify_lens[:, None]
    return (ok & in_range).int().cumprod(-1).sum(-1)


def _result(draft: DraftProposal, num_accepted: torch.Tensor, next_token: torch.Tensor) -> VerifyResult:
    tokens = torch.cat([draft.tokens, draft.tokens[:, :1]], dim=1)
    tokens.scatter_(1, num_accepted[:, None], next_token[:, None])
    return VerifyResult(num_accepted=num_accepted, tokens=tokens)


def _recover_or_bonus(p: torch.Tensor, q: torch.Tensor, a: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """p [R, γ+1, V], q [R, γ, V], a [R] accepted -> the token after each accepted prefix, drawn
    from the residual max(p - q, 0) where a draft was rejected (from p where the residual has
    no mass, or after the last verified draft). Only row a of p and q is read, picked per row."""
    r, g1, v = p.shape
    rows = torch.arange(r, device=p.device)
    p_a = p[rows, a]                                                             # [R, V]
    q_next = q[rows, a.clamp(max=g1 - 2)]                                        # [R, V]
    residual = (p_a - q_next).clamp_(min=0)
    has_mass = residual.sum(-1, keepdim=True) > 0
    rejected = (a < lens)[:, None]
    dist = torch.where(rejected & has_mass, residual, p_a)     # argmax(dist / E) needs no normalising
    return (dist / global_exponentials((r, v), p.device)).argmax(-1)
