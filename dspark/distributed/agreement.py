"""Step agreement: what every DP rank reports before a step, and the one key they all run.

Each rank packs its local shape into a fixed row of integers; one all-gather hands every rank
the whole table, and `agree` (a pure function of that table) derives the same `StepKey` on every
rank. No rank decides alone, so no rank can replay a different graph than its peers: the token
bucket holds the largest rank's tokens, the request bucket the largest rank's draft requests,
the page-table width the widest table, and a bucket runs captured only if every rank captured it.
An idle rank reports zero live requests and still runs the key, as a complete dummy query.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

from dspark.runner.step_key import StepKey

# status of a rank's row; anything but OK stops the whole group after this collective
OK, STOPPING, FAILED = 0, 1, 2


@dataclass
class LocalShape:
    """One rank's step as it planned it (its budget applied), plus the stats the front end shows."""
    status: int = OK
    live_reqs: int = 0           # requests with rows in this step (0: idle rank)
    tokens: int = 0              # target rows after the verify budget
    draft_reqs: int = 0          # requests in the drafter pass
    table_width: int = 0         # longest block table (pages) of the step
    captured_mask: int = 0       # bit i: token bucket i has a captured runner on this rank
    waiting: int = 0             # scheduler queue, for metrics and routing
    running: int = 0
    free_blocks: int = 0
    num_blocks: int = 0
    rejected: int = 0            # adds this rank's engine refused (reported back to rank 0)

    def encode(self) -> list[int]:
        return list(astuple(self))

    @classmethod
    def decode(cls, row: list[int]) -> "LocalShape":
        return cls(*(int(v) for v in row))

    @classmethod
    def width(cls) -> int:
        return len(fields(cls))


def smallest_holding(buckets: list[int], n: int) -> int | None:
    return next((b for b in buckets if b >= n), None)


def table_bucket(width: int) -> int:
    """Page-table capacity rounded up to a power of two (at least 16 pages), so a few widths cover
    every step and asymmetric ranks agree on one."""
    cap = 16
    while cap < width:
        cap *= 2
    return cap


def agree(rows: list[LocalShape], token_buckets: list[int], request_buckets: list[int]) -> StepKey:
    """The common key of a step, from every rank's row (in rank order)."""
    if any(r.status != OK for r in rows):
        raise ValueError("agree() is only defined when every rank is OK; check statuses first")
    if all(r.live_reqs == 0 for r in rows):
        return StepKey(idle=True, tokens=None, draft_reqs=0, table_width=0, captured=False)
    tokens = smallest_holding(token_buckets, max(r.tokens for r in rows))
    most_drafts = max(r.draft_reqs for r in rows)
    draft = 0
    if most_drafts:
        draft = smallest_holding(request_buckets, most_drafts) or most_drafts
    captured = tokens is not None and all(
        r.captured_mask >> token_buckets.index(tokens) & 1 for r in rows)
    width = table_bucket(max(r.table_width for r in rows))
    return StepKey(idle=False, tokens=tokens, draft_reqs=draft, table_width=width, captured=captured)


def captured_mask(token_buckets: list[int], captured: set[int]) -> int:
    """Bit i set when token bucket i has a captured runner."""
    if len(token_buckets) > 62:
        raise ValueError(f"{len(token_buckets)} token buckets do not fit one int64 capture mask")
    return sum(1 << i for i, b in enumerate(token_buckets) if b in captured)
