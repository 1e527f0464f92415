"""Which drafted slots fill the verify budget: the top B by current survival, on the device.

Survival is non-increasing along a block, so the top B slots of every request form a prefix and
their count is the request's verify length ℓ_r. Ties (saturated confidences give exactly equal
survivals) break toward the earlier request and the earlier position: a stable sort over the flat
index r·γ + k. That tie-break is what makes the allocation non-anticipating: changing draft x_k
changes only survivals of later slots of the same block, each no larger than slot k's and placed
after it, so it cannot change whether slot k or any earlier one is verified
(reference/dspark_algorithm.md §7.4, DESIGN.md invariant 4).
"""

from __future__ import annotations

import torch


def allocate(survival: torch.Tensor, budget: int) -> torch.Tensor:
    """survival [R, γ] -> verify lengths ℓ [R] (long, on the same device) with Σℓ = min(B, R·γ),
    without a host sync: `budget` is a host int fixed before the step."""
    r, gamma = survival.shape
    budget = max(0, min(budget, r * gamma))
    order = torch.sort(survival.flatten(), descending=True, stable=True).indices[:budget]
    lens = torch.zeros(r, dtype=torch.long, device=survival.device)
    return lens.index_add_(0, torch.div(order, gamma, rounding_mode="floor"),
                           torch.ones_like(order))
