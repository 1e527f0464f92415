"""Paged KV bookkeeping: fixed-size blocks, reference counts, all-or-nothing growth, rollback.

Pure host state; the worker only ever sees block tables and slot numbers derived from them.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.released: list[int] = []         # blocks freed since `take_released` (for the worker)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ensure(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow `block_table` to hold `num_tokens` slots; all or nothing (False: out of blocks)."""
        missing = self.blocks_needed(num_tokens) - len(block_table)
        if missing <= 0:
            return True
        if missing > len(self._free):
            return False
        for _ in range(missing):
            block = self._free.popleft()
            self.ref_counts[block] = 1
            block_table.append(block)
        return True

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Roll back: release whole blocks past `num_tokens` (rejected speculative positions)."""
        keep = self.blocks_needed(num_tokens)
        while len(block_table) > keep:
            self._release(block_table.pop())

    def share(self, block_table: list[int]) -> list[int]:
        """A second owner of the same blocks (a fork); each owner frees its reference."""
        for block in block_table:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"cannot share free block {block}")
            self.ref_counts[block] += 1
        return list(block_table)

    def free(self, block_table: list[int]) -> None:
        while block_table:
            self._release(block_table.pop())

    def _release(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"double free of KV block {block}")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)
            self.released.append(block)

    def take_released(self) -> list[int]:
        """The blocks freed since the last call: whatever was computed for them is stale."""
        released, self.released = self.released, []
        return released
