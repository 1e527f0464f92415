"""What flows between the draft, plan, verify and accept stages of a speculative step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftProposal:
    tokens: torch.Tensor               # [R, γ] drafted token ids (target vocabulary)
    probs: torch.Tensor | None         # [R, γ, V] q: the distribution each draft was sampled from
                                       #   (None when every request is greedy)
    confidence_logits: torch.Tensor | None   # [R, γ] z_k (None without a confidence head)


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor         # [R] drafts accepted (a_r <= ℓ_r)
    tokens: torch.Tensor               # [R, γ+1] x_1..x_a then the recovered or bonus token
