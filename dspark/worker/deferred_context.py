"""The drafter's context K/V of steps that draft nothing, appended only when a drafter reads it.

Every row the target runs must reach the drafter's cache before the drafter next reads it, but
not sooner: a step in which no request drafts (a prefill, or plain rows the policy chose) leaves
its rows here, and the next step that drafts appends, in one call, those in the blocks of the
requests it drafts. Rows of released blocks are dropped, so a request that never drafts again
never costs an append (docs/measurements.md). The rows live in one buffer that doubles up to
`max_bytes` (thousands of small held tensors had slowed every large allocation); when it is
full, dropped rows go and, if half of it is still live, the rest are appended.

Order keeps this exact: rows are appended in the order their steps ran, so a slot freed and
handed to another request ends with its new owner's K/V, and a row is dropped only when its
block was released after it was held. So every held row of a block is its current owner's, the
drafter reads no other request's cache, and the rows left held are positions their owners never
write again (prompt or plain decode rows, never a draft that could be rejected), so a later
direct append of other positions cannot be undone by them.
"""

from __future__ import annotations

from typing import Callable

import torch

from dspark.host_copy import device_tensor

# (aux_hidden [T, m*d_t], positions [T], write_rows [W] or None, write_slots [W]): the drafter's
# context append (Runner.append_context over the drafter's cache)
Append = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor], None]

DEFAULT_MAX_BYTES = 256 << 20    # held features; the rows of about 77,000 tokens for SmolLM2-135M in bf16
DONE = -2                        # the hold stamp of a row already appended (below every release stamp)
FIRST_ROWS = 256                 # the buffer's first size; it doubles as steps hold more


class DeferredContext:
    def __init__(self, num_blocks: int, block_size: int, device: torch.device,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.device = device
        self.aux: torch.Tensor | None = None     # [C, m*d_t] target features of the held rows
        self.positions = self.slots = self.index = torch.zeros(0, dtype=torch.long, device=device)  # [C]
        self.num_rows = 0              # rows held (the first num_rows of the buffers)
        self.holds = 0                 # steps held so far: a row and a release are stamped with it
        self.released_at = torch.full((num_blocks,), -1, dtype=torch.long, device=device)   # [NB]

    def max_rows(self, width: int, element_size: int) -> int:
        return max(1, self.max_bytes // (width * element_size))

    def fits(self, aux_hidden: torch.Tensor, write_rows: torch.Tensor | None) -> bool:
        """Whether a step's rows fit in what is left of `max_bytes`."""
        rows = aux_hidden.shape[0] if write_rows is None else write_rows.shape[0]
        return self.num_rows + rows <= self.max_rows(aux_hidden.shape[1], aux_hidden.element_size())

    def hold(self, aux_hidden: torch.Tensor, positions: torch.Tensor, write_rows: torch.Tensor | None,
             write_slots: torch.Tensor) -> None:
        """Keep a step's rows (`append_context`'s arguments) for a later append; they must fit.
        The features are copied (graph outputs are overwritten by the next replay)."""
        if not self.fits(aux_hidden, write_rows):
            raise ValueError("the held context rows would exceed max_bytes: make room first")
        if write_rows is not None:
            aux_hidden, positions = aux_hidden[write_rows], positions[write_rows]
        if self.aux is not None and self.num_rows + aux_hidden.shape[0] > self.aux.shape[0]:
            self._compact()                  # dropped and done rows go before the buffer grows
        start, stop = self.num_rows, self.num_rows + aux_hidden.shape[0]
        self._reserve(stop, aux_hidden)
        self.aux[start:stop] = aux_hidden
        self.positions[start:stop] = positions
        self.slots[start:stop] = write_slots
        self.index[start:stop] = self.holds
        self.num_rows = stop
        self.holds += 1

    def release(self, blocks: list[int] | None) -> None:
        """KV blocks freed since the last step: the rows held for them are not worth appending."""
        if blocks:
            self.released_at[device_tensor(blocks, torch.long, self.device)] = self.holds

    def make_room(self, append: Append) -> None:
        """Drop the rows of released blocks; append the rest if they still fill half the room."""
        self._compact()
        if self.aux is not None and 2 * self.num_rows >= self.max_rows(self.aux.shape[1], self.aux.element_size()):
            self.flush(append)

    def flush(self, append: Append, blocks: torch.Tensor | None = None) -> None:
        """Append the live held rows in step order, in one call: all of them, or those in
        `blocks` [B] (the KV blocks of the requests about to draft; the others stay held).
        Rows appended from `blocks` are marked done where they lie (moving every held row at
        each drafting step would cost as much as the rows), and go at the next compaction."""
        n = self.num_rows
        if n == 0:
            return
        live = self._live(n)                                                              # [n]
        take = live if blocks is None else live & torch.isin(self.slots[:n] // self.block_size, blocks)
        rows = take.nonzero().squeeze(1)
        taken = int(rows.shape[0])
        if taken:
            slots = self.slots[rows]
            # a slot written by two held steps (freed and handed on in between) keeps the later
            # write: index_copy_ with a repeated slot could keep either
            last = _last_writes(slots)
            append(self.aux[rows], self.positions[rows], last, slots[last])
        if blocks is None or taken == int(live.sum()):                # nothing left to append
            self.num_rows = 0
        elif taken:
            self.index[rows] = DONE

    def pending(self) -> int:
        """Held rows still to append (live: not done, their block not released after them)."""
        return int(self._live(self.num_rows).sum()) if self.num_rows else 0

    def _reserve(self, rows: int, like: torch.Tensor) -> None:
        """Buffers of at least `rows` rows, doubled from FIRST_ROWS, the held rows kept."""
        capacity = 0 if self.aux is None else self.aux.shape[0]
        if rows <= capacity:
            return
        size = max(FIRST_ROWS, capacity)
        while size < rows:
            size *= 2
        size = min(size, self.max_rows(like.shape[1], like.element_size()))
        aux = torch.empty(size, like.shape[1], dtype=like.dtype, device=like.device)
        n = self.num_rows
        if n:
            aux[:n] = self.aux[:n]
        self.aux = aux
        self.positions, self.slots, self.index = (torch.cat([t[:n], t.new_empty(size - n)])
                                                  for t in (self.positions, self.slots, self.index))

    def _live(self, n: int) -> torch.Tensor:
        """[n] held rows still to append: not done, and their block not released after them."""
        return self.released_at[self.slots[:n] // self.block_size] <= self.index[:n]

    def _compact(self) -> None:
        """Move the live held rows to the front, in order; dropped and done rows go."""
        n = self.num_rows
        if n == 0:
            return
        # dropping rows makes a data-dependent row count (one host sync on a GPU)
        live = self._live(n).nonzero().squeeze(1)
        m = int(live.shape[0])
        if 0 < m < n:
            for buffer in (self.aux, self.positions, self.slots, self.index):
                buffer[:m] = buffer[live]
        self.num_rows = m


def _last_writes(slots: torch.Tensor) -> torch.Tensor:
    """Indices of the last entry naming each distinct slot of `slots` (the writes that stand)."""
    order = torch.sort(slots, stable=True).indices        # equal slots keep their step order
    ordered = slots[order]
    last = torch.ones_like(ordered, dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    return order[last]
