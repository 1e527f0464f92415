"""Acceptance: greedy exact match, or lossless rejection sampling against the draft's q.

At temperature > 0 draft x_j is accepted with probability min(1, p_{j-1}(x_j) / q_j(x_j)); at the
first rejection the next token is drawn from the residual max(p - q, 0) (renormalised), and when
every verified draft passes a bonus token is drawn from p.  Trimmed drafts (j > ℓ) are simply not
verified.  Everything stays on the device: no host sync until the step's single copy.
"""

from __future__ import annotations

import torch

from dspark.spec.types import DraftProposal, VerifyResult
from dspark.worker.sampler import SamplingTensors, exponential_noise, processed_probs


def uniform_noise(shape: tuple[int, int], generators: list[torch.Generator | None],
                  device: torch.device) -> torch.Tensor:
    """U(0,1) [R, n]; seeded requests draw from their own generator."""
    u = torch.rand(shape, device=device)
    for row, gen in enumerate(generators):
        if gen is not None:
            u[row] = torch.rand(shape[1], generator=gen, device=gen.device).to(device)
    return u


def accept(target_logits: torch.Tensor, verify_lens: torch.Tensor, draft: DraftProposal,
           st: SamplingTensors) -> VerifyResult:
    """target_logits [R, γ+1, V] (row j predicts the token after x_j, x_0 the anchor)."""
    if st.all_greedy:
        return accept_greedy(target_logits.argmax(-1), verify_lens, draft)
    r, g1, v = target_logits.shape
    gamma = g1 - 1
    target_argmax = target_logits.argmax(-1)                                   # [R, γ+1]
    ok = draft.tokens == target_argmax[:, :gamma]                              # [R, γ]
    p = processed_probs(target_logits.reshape(r * g1, v), st.repeat(g1)).view(r, g1, v)
    p_x = p[:, :gamma].gather(-1, draft.tokens[..., None]).squeeze(-1)         # [R, γ]
    q_x = draft.probs.gather(-1, draft.tokens[..., None]).squeeze(-1)          # [R, γ]
    u = uniform_noise((r, gamma), st.generators, target_logits.device)
    ok = torch.where(st.greedy[:, None], ok, u * q_x <= p_x)
    num_accepted = _accepted_prefix(ok, verify_lens)
    next_token = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)     # [R]
    sampled = _recover_or_bonus(p, draft.probs, num_accepted, verify_lens, st)
    next_token = torch.where(st.greedy, next_token, sampled)
    return _result(draft, num_accepted, next_token)


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


def _recover_or_bonus(p: torch.Tensor, q: torch.Tensor, a: torch.Tensor, lens: torch.Tensor,
                      st: SamplingTensors) -> torch.Tensor:
    r, g1, v = p.shape
    p_a = p.gather(1, a[:, None, None].expand(r, 1, v)).squeeze(1)                       # [R, V]
    q_next = q.gather(1, a.clamp(max=g1 - 2)[:, None, None].expand(r, 1, v)).squeeze(1)  # [R, V]
    residual = (p_a - q_next).clamp_(min=0)
    has_mass = residual.sum(-1, keepdim=True) > 0
    rejected = (a < lens)[:, None]
    dist = torch.where(rejected & has_mass, residual, p_a)     # argmax(dist / E) needs no normalising
    noise = exponential_noise((r, v), st.generators, p.device)
    return (dist / noise).argmax(-1)
