"""The failure policy: a rank that raises, dies or stalls stops the whole group, named.

Every collective carries the group timeout, so a broken peer surfaces on rank 0 as an exception
within that timeout. Rank 0 then works out who broke and why from what the ranks left behind:
an error a rank recorded before exiting (it raised), a local process's exit code (it died), or
the count of collectives each rank entered (the one that fell behind stalled).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

from dspark.distributed.comm import RankGroup
from dspark.engine.engine import EngineStopped


@dataclass
class GroupFailure:
    rank: int
    cause: str

    def __str__(self) -> str:
        return f"data-parallel rank {self.rank} {self.cause}"


class DPGroupError(EngineStopped):
    """The group stopped: one rank failed. Nothing more runs on any rank."""

    def __init__(self, failure: GroupFailure):
        super().__init__(f"{failure}; the data-parallel group has stopped")
        self.failure = failure


def diagnose(group: RankGroup, processes: dict, detail: str, settle_s: float = 1.0) -> GroupFailure:
    """Name the rank behind a failed collective. `processes`: rank -> local Process (spawned here)."""
    deadline = time.monotonic() + settle_s
    while True:                 # a dying rank's error or exit code can trail the broken socket
        errors = _safe(group.errors, {})
        if errors:
            rank = min(errors)
            return GroupFailure(rank, f"raised: {errors[rank]}")
        dead = {r: p.exitcode for r, p in processes.items() if p.exitcode is not None}
        if dead:
            rank = min(dead)
            return GroupFailure(rank, f"died ({exit_text(dead[rank])})")
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    progress = _safe(group.progress, {})
    mine = progress.get(group.rank, (group.entered, "?"))[0]
    behind = sorted(r for r in range(group.world_size) if progress.get(r, (0, ""))[0] < mine)
    if behind:
        rank = behind[0]
        count, what = progress.get(rank, (0, "start-up"))
        return GroupFailure(rank, f"stalled: no progress past collective {count} ({what}) within the "
                                  f"{group.timeout.total_seconds():g} s timeout ({detail})")
    return GroupFailure(group.rank, f"lost its peers: {detail}")


def exit_text(code: int) -> str:
    """How a process ended, as the failure report words it (a signal by name)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _safe(fn, default):
    try:
        return fn()
    except Exception:          # noqa: BLE001 (the store may be gone with its host)
        return default
