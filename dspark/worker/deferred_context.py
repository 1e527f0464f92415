"""The drafter's context K/V of steps that draft nothing, appended later in one call.

Every row the target runs must reach the drafter's cache before the drafter next reads it, but
not sooner. A step in which no request drafts (a prefill, or plain decode rows the confidence
planner chose) would otherwise pay a drafter append of its own, and at a few rows that append
costs about the same for one row as for a dozen (the context projections' weights are read
whole, plus a few operator calls): on a 2-core CPU about 0.4 ms, 4% of a batch-1 decode step.
So such steps leave their rows here, and the next step that drafts appends them all before its
drafter pass, as does any step that brings the rows held to `max_rows`.

Order is what keeps this exact: the rows are appended in the order their steps ran, and before
any later step's own rows, so a slot that was freed and handed to another request ends with its
new owner's K/V, as it would have with every append on time. The drafter only ever reads its
cache in a drafting step, after the flush.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.models.drafter import Drafter
from dspark.spec.draft import KVCaches, append_context


@dataclass
class HeldRows:
    """One step's rows for the drafter's context. The features are copied (graph outputs are
    overwritten by the next replay); positions and slots are the step's own fresh tensors."""
    aux_hidden: torch.Tensor       # [T, m*d_t] target features of the step's rows
    positions: torch.Tensor        # [T]
    rows: torch.Tensor             # [W] rows of aux_hidden that store K/V
    slots: torch.Tensor            # [W] their cache slots


class DeferredContext:
    def __init__(self, max_rows: int = 64):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.held: list[HeldRows] = []
        self.num_rows = 0              # rows held, stored or not
        self.deferred_steps = 0        # steps whose append was deferred (stats)
        self.flushes = 0               # appends of held rows

    def hold(self, aux_hidden: torch.Tensor, positions: torch.Tensor, write_rows: torch.Tensor | None,
             write_slots: torch.Tensor) -> None:
        """Keep a step's rows (`append_context`'s arguments) for a later append."""
        t = aux_hidden.shape[0]
        rows = torch.arange(t, device=aux_hidden.device) if write_rows is None else write_rows
        self.held.append(HeldRows(aux_hidden.clone(), positions, rows, write_slots))
        self.num_rows += t
        self.deferred_steps += 1

    @property
    def full(self) -> bool:
        return self.num_rows >= self.max_rows

    def flush(self, drafter: Drafter, kv: KVCaches) -> int:
        """Append every held row in step order, in one call; returns the rows appended."""
        if not self.held:
            return 0
        offsets, total = [], 0
        for h in self.held:
            offsets.append(total)
            total += h.aux_hidden.shape[0]
        aux = torch.cat([h.aux_hidden for h in self.held])                        # [T, m*d_t]
        positions = torch.cat([h.positions for h in self.held])                   # [T]
        rows = torch.cat([h.rows + off for h, off in zip(self.held, offsets)])   # [W]
        slots = torch.cat([h.slots for h in self.held])                           # [W]
        # a slot written by two held steps (freed and handed on in between) keeps the later
        # write: index_copy_ with a repeated slot could keep either
        last = _last_writes(slots)
        append_context(drafter, kv, aux, positions, rows[last], slots[last])
        self.held.clear()
        self.num_rows = 0
        self.flushes += 1
        return total


def _last_writes(slots: torch.Tensor) -> torch.Tensor:
    """Indices of the last entry naming each distinct slot of `slots` (the writes that stand)."""
    order = torch.sort(slots, stable=True).indices        # equal slots keep their step order
    ordered = slots[order]
    last = torch.ones_like(ordered, dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    return order[last]
