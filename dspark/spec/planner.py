"""The verify budget: how many drafted tokens the next step verifies in total.

The engine's step cost is far from linear in the tokens it verifies (graph buckets, GEMM tiles,
a fixed per-step floor), so the budget is chosen against a measured cost table: the B that
maximises expected committed tokens per millisecond,

    B* = argmax_b (N_sampling + Σ_{i<b} S_i) / (draft_cost[R] + verify_cost[T_other + b]),

over the sorted survivals S of an earlier step (reference/dspark_algorithm.md §7.4, §7.6). Using
only earlier confidences is what keeps the budget independent of the tokens it admits
(non-anticipation); which slots fill it is decided on the device from the current survivals
(`allocate.py`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch


@dataclass
class CostTable:
    """Measured step costs (milliseconds) of one target + drafter on one device."""
    fingerprint: dict              # device, model, dtype, drafter, buckets: a table fits one setup
    verify_ms: list[float]         # [T_max + 1] target step over t tokens (index 0 unused)
    draft_ms: list[float]          # [R_max + 1] drafter pass for r requests (index 0 unused)
    context_len: int = 0           # KV context every profiled request had
    method: str = ""               # e.g. "median of 10 after 3 warm-up, made monotone"

    def __post_init__(self) -> None:
        if len(self.verify_ms) < 2 or len(self.draft_ms) < 2:
            raise ValueError("a cost table needs verify costs for t >= 1 and draft costs for r >= 1")
        if any(not c > 0 for c in self.verify_ms[1:] + self.draft_ms[1:]):
            raise ValueError("cost table entries must be positive")

    @property
    def max_tokens(self) -> int:
        return len(self.verify_ms) - 1

    @property
    def max_requests(self) -> int:
        return len(self.draft_ms) - 1

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"format": 1, **asdict(self)}, f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CostTable":
        try:
            with open(path) as f:
                raw = json.load(f)
            if raw.pop("format", None) != 1:
                raise ValueError("unknown format")
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


def plan_budget(survival: torch.Tensor, table: CostTable, num_sampling: int, other_tokens: int,
                min_gain: float = 0.05) -> int:
    """survival [R, γ] cumulative (STS-calibrated) survivals from an earlier step -> B*.

    `other_tokens` are the step's tokens besides drafts (anchor rows and prefill chunks). The
    result is R·γ (verify everything) unless trimming is predicted to gain at least `min_gain`
    in tokens per millisecond; budgets beyond the table's largest step are never chosen.
    """
    r, gamma = survival.shape
    full = r * gamma
    if full == 0:
        return 0
    if r > table.max_requests or other_tokens + 1 > table.max_tokens:
        raise ValueError(f"the cost table covers {table.max_requests} requests and "
                         f"{table.max_tokens} tokens; this step has {r} and {other_tokens}+")
    reach = min(full, table.max_tokens - other_tokens)                 # largest budget priced
    s = survival.detach().float().flatten().cpu().sort(descending=True).values
    gain = num_sampling + torch.cat([torch.zeros(1), s.cumsum(0)])[:reach + 1]      # [reach+1]
    verify = torch.tensor(table.verify_ms[other_tokens:other_tokens + reach + 1])
    rate = gain / (table.draft_ms[r] + verify)
    best = int(rate.argmax())                                          # first maximum
    if reach < full:
        return best
    pays = rate[best] > rate[full] and rate[best] >= (1.0 + min_gain) * rate[full]
    return best if pays else full
