"""The key a step runs at: its graph buckets, fixed before the step runs.

Alone, a worker picks the smallest buckets that hold its step. Under data parallelism the ranks
agree on one key (dspark/distributed/agreement.py) and each worker pads its step to it, an idle
rank running the key as a complete dummy query.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepKey:
    """The graph key the whole group runs this step (identical on every rank)."""
    idle: bool                   # no rank has live work: nobody runs a forward
    tokens: int | None           # target token bucket; None: above the largest, run unpadded
    draft_reqs: int              # drafter request bucket (0: no rank drafts)
    table_width: int             # page-table capacity every rank pads its tables to
    captured: bool               # every rank captured `tokens` (else all run it eagerly)
