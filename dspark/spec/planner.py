"""The plan of a step: which requests draft, how many drafted tokens are verified in total, and
which slots fill that budget.

Step cost is far from linear in the tokens verified (graph buckets, GEMM tiles, a per-step
floor), so plans are priced with a measured cost table (docs/speculation.md, "The plan";
reference/dspark_algorithm.md §7.4, §7.6). Pricing runs on the host over a few hundred numbers,
hence numpy: torch's per-operator dispatch is a visible share of a small step. The slots are
picked on the device (`allocate`), after the drafter pass.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import torch

FORMAT = 2                # 2: verify costs per request count
MEMO_ENTRIES = 256        # remembered results per cost list (a step's shapes repeat under steady load)


@dataclass
class CostTable:
    """Measured step costs (milliseconds) of one target + drafter on one device. Verify costs
    have a row per request count in `verify_requests` (interpolated between them): each request
    reads its own K/V context, so many one-token rows cost more than a few blocks of the same
    tokens."""
    fingerprint: dict              # device, model, dtype, drafter, buckets: a table fits one setup
    verify_ms: list                # [N][T_max + 1] target step of verify_requests[n] requests over t
                                   #   tokens (index 0 unused); a flat list: one row, any count
    draft_ms: list[float]          # [R_max + 1] drafter pass for r requests (index 0 unused)
    context_len: int = 0           # KV context every profiled request had
    method: str = ""               # e.g. "median of 10 after 3 warm-up, made monotone"
    verify_requests: list[int] | None = None    # [N] ascending request counts of the rows
    held_row_ms: float = 0.0       # appending one held context row to the drafter's cache

    def __post_init__(self) -> None:
        if self.verify_ms and not isinstance(self.verify_ms[0], (list, tuple)):
            self.verify_ms = [list(self.verify_ms)]
        if self.verify_requests is None:
            self.verify_requests = [1] * (len(self.verify_ms) == 1)
        if len(self.verify_requests) != len(self.verify_ms) or not self.verify_ms:
            raise ValueError("a cost table needs one verify row per request count")
        if sorted(set(self.verify_requests)) != list(self.verify_requests) or self.verify_requests[0] < 1:
            raise ValueError("the verify rows' request counts must ascend from 1 or more")
        if len({len(row) for row in self.verify_ms}) != 1:
            raise ValueError("every verify row must cover the same token counts")
        if len(self.verify_ms[0]) < 2 or len(self.draft_ms) < 2:
            raise ValueError("a cost table needs verify costs for t >= 1 and draft costs for r >= 1")
        if any(not c > 0 for row in self.verify_ms for c in row[1:]) or any(not c > 0 for c in self.draft_ms[1:]):
            raise ValueError("cost table entries must be positive")
        self._memo: dict[str, tuple[list, np.ndarray, dict]] = {}    # per list: (list, array, results)

    def _remembered(self, name: str, key, compute) -> np.ndarray:
        """compute(the list `name` as an array), read-only and kept by `key` while `name` is the
        same list (one assigned anew is converted again; entries are never changed in place):
        steady load prices the same stretch of the table every step, and between steps each
        small numpy call costs several microseconds."""
        costs = getattr(self, name)
        memo = self._memo.get(name)
        if memo is None or memo[0] is not costs:
            memo = self._memo[name] = (costs, np.asarray(costs, dtype=np.float64), {})
        results = memo[2]
        result = results.get(key)
        if result is None:
            if len(results) >= MEMO_ENTRIES:
                results.clear()
            result = results[key] = compute(memo[1])
            result.setflags(write=False)
        return result

    @property
    def max_tokens(self) -> int:
        return len(self.verify_ms[0]) - 1

    @property
    def max_requests(self) -> int:
        return len(self.draft_ms) - 1

    def verify_costs(self, start: int, stop: int, requests: int = 1) -> np.ndarray:
        """[stop - start] verify cost of t = start..stop-1 tokens in a step of `requests`
        requests; past the table, the last measured slope (a larger step never costs less)."""
        return self._remembered("verify_ms", (start, stop, requests),
                                lambda rows: _extrapolated(self._verify_row(rows, requests), start, stop))

    def _verify_row(self, rows: np.ndarray, requests: int) -> np.ndarray:
        """[T_max + 1] the verify costs of a step of `requests` requests: linear between the
        measured counts around it, the nearest row outside them."""
        counts = self.verify_requests
        if requests <= counts[0]:
            return rows[0]
        if requests >= counts[-1]:
            return rows[-1]
        hi = int(np.searchsorted(counts, requests))
        w = (requests - counts[hi - 1]) / (counts[hi] - counts[hi - 1])
        return (1.0 - w) * rows[hi - 1] + w * rows[hi]

    def draft_costs(self, sizes) -> np.ndarray:
        """Drafter cost for each request count in `sizes` (0 requests: no drafter pass)."""
        sizes = np.asarray(sizes, dtype=np.int64)
        return self._remembered("draft_ms", (sizes.shape, sizes.tobytes()), lambda table: np.where(
            sizes > 0, _extrapolated(table, 0, int(sizes.max()) + 1)[sizes], 0.0))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"format": FORMAT, **asdict(self)}, f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CostTable":
        try:
            with open(path) as f:
                raw = json.load(f)
            if raw.pop("format", None) != FORMAT:
                raise ValueError(f"not format {FORMAT} (verify costs per request count)")
            return cls(**raw)
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"{path!r} is not a valid cost table: {e}") from e

    def check_fingerprint(self, expected: dict) -> None:
        """A table measured for another device, model, dtype or bucket set would plan wrong
        budgets silently: refuse it, naming what differs."""
        diff = {k: (self.fingerprint.get(k), v) for k, v in expected.items()
                if self.fingerprint.get(k) != v}
        if diff:
            detail = "; ".join(f"{k}: table has {a!r}, engine has {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"the cost table does not match this engine ({detail}); "
                             f"run `dspark profile` again")


@dataclass
class StepPlan:
    """What the next step does with its speculative requests, fixed on the host before it runs."""
    drafted: list[bool]     # per speculative request: draft a block (False: a plain decode row)
    budget: int             # drafts verified in total, over the drafted requests
    full: int               # R·γ: every draft of every request
    predicted_accepted: float = 0.0   # drafts the policy expects the target to accept
    held_ms: float = 0.0              # appending the held context rows of the drafted requests

    @property
    def verify_all(self) -> bool:
        return all(self.drafted) and self.budget == self.full


def plan_step(survival: np.ndarray, table: CostTable, num_sampling: int, other_tokens: int,
              min_gain: float = 0.05, prefer_verify_all: bool = True, joining_tokens: int = 0, step_ms: float = 0.0,
              draft_extra: np.ndarray | None = None) -> StepPlan:
    """survival [R, γ] cumulative (STS-calibrated) survivals from an earlier step -> the plan
    maximising tokens per millisecond (docs/speculation.md, "The plan").

    Candidate draft sets are the r requests with the most expected accepted drafts (Σ_k S_k),
    each with its best budget. With `prefer_verify_all` the result is
    verify-all unless a plan gains `min_gain` over it; drafting must gain `min_gain` over a plain
    step. `joining_tokens` of prefill join whatever is drafted: drafts are priced on top of them
    but judged against the decode step without them. `step_ms` is every step's cost beyond the
    table; `draft_extra` [R] is each request's cost besides the drafter pass (its held rows).
    """
    r_all, gamma = survival.shape
    full = r_all * gamma
    if full == 0:
        return StepPlan(drafted=[True] * r_all, budget=0, full=0)
    s = np.clip(np.asarray(survival, dtype=np.float64), 0.0, None)
    extra = np.zeros(r_all) if draft_extra is None else np.asarray(draft_extra, dtype=np.float64)
    requests = max(1, num_sampling)
    verify = table.verify_costs(other_tokens, other_tokens + full + 1, requests)                # [B]
    if joining_tokens > 0:                 # the decode step's cost plus what drafts add on top
        start = other_tokens + joining_tokens
        joined = table.verify_costs(start, start + full + 1, requests)
        verify = joined - joined[0] + verify[0]
    verify = verify + step_ms
    plain_rate = num_sampling / verify[0]
    full_rate = (num_sampling + s.sum()) / (table.draft_costs([r_all])[0] + extra.sum() + verify[full])
    bound = _drafting_bound(s, extra, table, num_sampling, verify)
    if prefer_verify_all and max(bound, plain_rate) < (1.0 + min_gain) * full_rate:
        return StepPlan(drafted=[True] * r_all, budget=full, full=full)    # nothing beats it enough
    if bound < (1.0 + min_gain) * plain_rate:
        rank, size, budget, best_rate = np.zeros(r_all, dtype=np.int64), 0, 0, plain_rate
    else:
        rank, size, budget, best_rate = _best_set(s, extra, table, num_sampling, verify, plain_rate, min_gain)
    if prefer_verify_all and not (best_rate > full_rate and best_rate >= (1.0 + min_gain) * full_rate):
        size, budget = r_all, full
    return StepPlan(drafted=(rank < size).tolist(), budget=budget, full=full)


def _drafting_bound(s: np.ndarray, extra: np.ndarray, table: CostTable, num_sampling: int,
                    verify: np.ndarray) -> float:
    """An upper bound on the tokens/ms of every draft set and budget at once, in O(R·γ) where
    pricing every set is O(R²·γ): b verified drafts yield at most the b best survivals of any
    request and cost at least a drafter pass over the fewest, cheapest requests holding b slots."""
    if num_sampling <= 0:
        return np.inf
    gamma = s.shape[1]
    slots = np.arange(s.size + 1)
    holders = np.maximum(1, -(-slots // gamma))                                           # [B]
    cheapest = np.concatenate([[0.0], np.cumsum(np.sort(extra))])                          # [R + 1]
    cost = table.draft_costs(holders) + cheapest[holders] + verify                         # [B]
    yield_ = num_sampling + np.concatenate([[0.0], np.cumsum(np.sort(s, axis=None)[::-1])])     # [B]
    return float((yield_ / cost).max())


def _best_set(s: np.ndarray, extra: np.ndarray, table: CostTable, num_sampling: int, verify: np.ndarray,
              plain_rate: float, min_gain: float) -> tuple[np.ndarray, int, int, float]:
    """Every candidate draft set with its best budget: (rank of each request, set size, budget,
    rate) of the best, drafting nothing unless drafting beats a plain step by `min_gain`. A set
    verifies at least one draft per member: a request drafted for nothing is a plain row that
    also paid for a drafter pass."""
    r_all, gamma = s.shape
    full = r_all * gamma
    order = np.argsort(-s.sum(1), kind="stable")                               # descending, stable
    rank = np.empty_like(order)
    rank[order] = np.arange(r_all)
    sizes = np.arange(r_all + 1)                                               # [C] draft-set sizes
    gain = num_sampling + _set_prefix_sums(s, rank, sizes)                     # [C, B]
    members = np.concatenate([[0.0], np.cumsum(extra[order])])                 # [R + 1] by rank
    draft = table.draft_costs(sizes) + members[sizes]                          # [C]
    cost = draft[:, None] + verify[None, :]                                     # [C, B]
    rate = gain / cost                                                          # [C, B]
    rate[0, 0] = plain_rate                                                    # no drafter pass
    budgets = np.arange(full + 1)[None, :]
    rate[(budgets > sizes[:, None] * gamma) | (budgets < sizes[:, None])] = -np.inf
    # the smallest set, and within it the largest budget, of those that reach the best rate: a
    # draft priced at 0 that the step's bucket verifies for free is still verified
    per_set = full - rate[:, ::-1].argmax(1)                                   # [C] last maximum
    c = int(rate[np.arange(len(sizes)), per_set].argmax())
    size, budget = int(sizes[c]), int(per_set[c])
    best_rate = float(rate[c, budget])
    if size > 0 and best_rate < (1.0 + min_gain) * plain_rate:
        size, budget, best_rate = 0, 0, plain_rate            # drafting must pay for itself too
    return rank, size, budget, best_rate


def _set_prefix_sums(s: np.ndarray, rank: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """[C, R·γ + 1]: for each draft set (the sizes[c] requests of lowest rank), the sums of its b
    largest survivals, b = 0..R·γ (past the set's own slots add 0). One sort serves every set: a
    set's slots in descending order are the global order's slots it owns, compacted by a scatter."""
    r_all, gamma = s.shape
    n = r_all * gamma
    flat = np.asarray(s, dtype=np.float64).reshape(-1)
    order = np.argsort(-flat, kind="stable")                                    # [R·γ] descending
    values = flat[order]
    owner = np.repeat(np.asarray(rank), gamma)[order]                           # [R·γ]
    member = owner[None, :] < np.asarray(sizes)[:, None]                        # [C, R·γ]
    slot = np.where(member, member.cumsum(1) - 1, n)                            # non-members: column n
    compact = np.zeros((len(sizes), n + 1))
    np.put_along_axis(compact, slot, np.broadcast_to(values, slot.shape), 1)
    return np.concatenate([np.zeros((len(sizes), 1)), compact[:, :n].cumsum(1)], 1)


def _extrapolated(table: np.ndarray, start: int, stop: int) -> np.ndarray:
    """table[start:stop] from a table indexed 0..N, continued past N along its last stretch
    (from N/2 to N), so steps larger than anything profiled are still priced, and priced high."""
    n = len(table) - 1
    idx = np.arange(start, stop)
    inside = table[np.minimum(idx, n)]
    half = max(1, n // 2)
    slope = max(0.0, float(table[n] - table[half]) / max(1, n - half))
    return np.where(idx > n, table[n] + slope * (idx - n), inside)


def allocate(survival: torch.Tensor, budget: int) -> torch.Tensor:
    """survival [R, γ] -> verify lengths ℓ [R] (long, on the same device) with Σℓ = min(B, R·γ),
    without a host sync: `budget` is a host int fixed before the step.

    The top B slots by current survival. Survival is non-increasing along a block, so a
    request's top slots form a prefix and their count is its ℓ. Ties (saturated confidences give
    exactly equal survivals) break toward the earlier request and position: a stable sort over
    the flat index r·γ + k. That tie-break makes the allocation non-anticipating: changing draft
    x_k changes only survivals of later slots of the same block, each no larger than slot k's
    and placed after it, so it cannot change whether slot k or an earlier one is verified
    (reference/dspark_algorithm.md §7.4, DESIGN.md invariant 4).
    """
    r, gamma = survival.shape
    budget = max(0, min(budget, r * gamma))
    order = torch.sort(survival.flatten(), descending=True, stable=True).indices[:budget]
    lens = torch.zeros(r, dtype=torch.long, device=survival.device)
    return lens.index_add_(0, torch.div(order, gamma, rounding_mode="floor"), torch.ones_like(order))
