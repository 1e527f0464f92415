"""The drafter's context K/V of steps that draft nothing, appended only when a drafter reads it.

Every row the target runs must reach the drafter's cache before the drafter next reads it, but
not sooner. A step in which no request drafts (a prefill, or plain decode rows the confidence
planner chose) leaves its rows here, and the next step that drafts appends them all before its
drafter pass, in one call. Under load the planner may draft nothing for hundreds of steps, and
many requests finish in between: their rows are dropped when their KV blocks are released, so a
request that never drafts again never costs an append (at 16 requests on a 2-core CPU the
appends had cost about 2% of plain decoding's time). Rows are held up to `max_bytes`; when that
fills, the rows of released blocks are dropped and, if at least half of it is still live, the
rest are appended.

Order is what keeps this exact: the rows are appended in the order their steps ran, and before
any later step's own rows, so a slot that was freed and handed to another request ends with its
new owner's K/V, as it would have with every append on time. A row is dropped only when its
block was released after the row was held; a block released and handed on keeps its new
owner's rows. The drafter only ever reads its cache in a drafting step, after the flush.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.models.drafter import Drafter
from dspark.spec.draft import KVCaches, append_context

DEFAULT_MAX_BYTES = 64 << 20     # held features; the rows of about 11,000 tokens for SmolLM2-135M


@dataclass
class HeldRows:
    """Rows for the drafter's context, only those that store K/V. The features are copied (graph
    outputs are overwritten by the next replay)."""
    aux_hidden: torch.Tensor       # [W, m*d_t] target features
    positions: torch.Tensor        # [W]
    slots: torch.Tensor            # [W] their cache slots
    index: int                     # the latest hold they came from (releases after it drop them)


class DeferredContext:
    def __init__(self, num_blocks: int, block_size: int, device: torch.device,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 1 or num_blocks < 1 or block_size < 1:
            raise ValueError(f"max_bytes, num_blocks and block_size must be >= 1, got {max_bytes}, "
                             f"{num_blocks} and {block_size}")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.held: list[HeldRows] = []
        self.num_bytes = 0             # features held
        self.holds = 0                 # steps held so far: a release is stamped with it
        self.released_at = torch.full((num_blocks,), -1, dtype=torch.long, device=device)   # [NB]
        self.deferred_steps = 0        # steps whose append was deferred (stats)
        self.flushes = 0               # appends of held rows
        self.dropped_rows = 0          # rows of released blocks never appended

    @property
    def num_rows(self) -> int:
        return sum(h.slots.shape[0] for h in self.held)

    def hold(self, aux_hidden: torch.Tensor, positions: torch.Tensor, write_rows: torch.Tensor | None,
             write_slots: torch.Tensor) -> None:
        """Keep a step's rows (`append_context`'s arguments) for a later append."""
        if write_rows is not None:
            aux_hidden, positions = aux_hidden[write_rows], positions[write_rows]
        else:
            aux_hidden = aux_hidden.clone()
        self.held.append(HeldRows(aux_hidden, positions, write_slots, self.holds))
        self.holds += 1
        self.num_bytes += aux_hidden.numel() * aux_hidden.element_size()
        self.deferred_steps += 1

    def release(self, blocks: list[int] | None) -> None:
        """KV blocks freed since the last step: the rows held for them are not worth appending."""
        if blocks:
            self.released_at[torch.tensor(blocks, device=self.released_at.device)] = self.holds

    @property
    def full(self) -> bool:
        return self.num_bytes >= self.max_bytes

    def make_room(self, drafter: Drafter, kv: KVCaches) -> None:
        """Drop the rows of released blocks; append the rest if they still fill half the room."""
        self._compact()
        if 2 * self.num_bytes >= self.max_bytes:
            self.flush(drafter, kv)

    def flush(self, drafter: Drafter, kv: KVCaches) -> int:
        """Append every live held row in step order, in one call; returns the rows appended."""
        self._compact()
        if not self.held:
            return 0
        h = self.held[0]
        # a slot written by two held steps (freed and handed on in between) keeps the later
        # write: index_copy_ with a repeated slot could keep either
        last = _last_writes(h.slots)
        append_context(drafter, kv, h.aux_hidden, h.positions, last, h.slots[last])
        self.held.clear()
        self.num_bytes = 0
        self.flushes += 1
        return int(last.shape[0])

    def _compact(self) -> None:
        """The held rows as one entry, without those whose block was released after them."""
        if not self.held:
            return
        # dropping rows makes a data-dependent row count (one host sync on a GPU, per flush)
        keep = [self.released_at[h.slots // self.block_size] <= h.index for h in self.held]   # [W_i]
        total = sum(h.slots.shape[0] for h in self.held)
        aux = torch.cat([h.aux_hidden[k] for h, k in zip(self.held, keep)])
        merged = HeldRows(aux, torch.cat([h.positions[k] for h, k in zip(self.held, keep)]),
                          torch.cat([h.slots[k] for h, k in zip(self.held, keep)]), self.held[-1].index)
        self.dropped_rows += total - merged.slots.shape[0]
        self.held = [merged] if merged.slots.shape[0] else []
        self.num_bytes = aux.numel() * aux.element_size()


def _last_writes(slots: torch.Tensor) -> torch.Tensor:
    """Indices of the last entry naming each distinct slot of `slots` (the writes that stand)."""
    order = torch.sort(slots, stable=True).indices        # equal slots keep their step order
    ordered = slots[order]
    last = torch.ones_like(ordered, dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    return order[last]
