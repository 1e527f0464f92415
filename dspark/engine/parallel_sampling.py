"""Parallel sampling: the n completions of one prompt (`SamplingParams.n > 1`) prefill it once.

Fan-out follows vLLM (`ParentRequest.get_child_info`): completion i is a request of its own, id
f"{i}_{request_id}", with n = 1 and, given a seed, `seed + i`; so `n=4, seed=s` returns exactly
what four requests seeded s..s+3 return, alone or in any batch, with or without a drafter.

The prompt's full blocks before its last token, [0, S) with S = (P - 1) // block_size *
block_size, are computed once by the completion admitted first (its siblings wait parked), then
shared by reference count (`BlockManager.share`), the drafter's context K/V with them; each
completion computes the rest of the prompt into blocks of its own. Why recompute that tail
rather than copy-on-write the partly filled last block: every completion runs the prompt's last
row anyway (its first token is sampled there with its own seed), so the tail costs at most
block_size - 1 rows, and no shared block is ever written again: no device-side copy of either
cache, none to order before a step, none to meet the held drafter context (deferred_context.py).
When the queue's head cannot be admitted with nothing running, idle groups let their shared
blocks go, so shared prompts never deadlock the cache.
"""

from __future__ import annotations

import dataclasses
import time

from dspark.engine.block_manager import BlockManager
from dspark.engine.sequence import Sequence, SequenceStatus
from dspark.outputs import TokenLogprobs
from dspark.sampling_params import SamplingParams


def request_ids(request_id: str, n: int) -> list[str]:
    """The engine ids of a request's completions: its own id when n = 1, else vLLM's child ids."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index`'s params: n = 1 and, with a seed, seed + index (vLLM's rule)."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


def fan_out(request_id: str, prompt_ids: list[int], params: SamplingParams, prompt: str | None,
            arrival_time: float | None, block_size: int) -> list[Sequence]:
    """The sequences of one request: itself when n = 1, else its n completions in one group."""
    if params.n == 1:
        return [Sequence(request_id, prompt_ids, params, prompt=prompt, arrival_time=arrival_time)]
    arrival_time = arrival_time or time.perf_counter()
    group = SampleGroup(request_id, (len(prompt_ids) - 1) // block_size * block_size)
    for i, seq_id in enumerate(request_ids(request_id, params.n)):
        seq = Sequence(seq_id, prompt_ids, child_params(params, i), prompt=prompt,
                       arrival_time=arrival_time)
        seq.index, seq.group = i, group
        group.children.append(seq)
    return list(group.children)


class SampleGroup:
    """The completions of one request and the prompt blocks they share."""

    def __init__(self, request_id: str, shared_len: int):
        self.request_id = request_id
        self.shared_len = shared_len           # S: prompt tokens in the shared blocks (0: none)
        self.children: list[Sequence] = []
        self.blocks: list[int] | None = None   # the shared blocks once computed (one reference)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None   # theirs, when asked
        self.parked: list[Sequence] = []       # waiting for a sibling to compute the shared part

    def running(self, other_than: Sequence | None = None) -> bool:
        return any(c.status == SequenceStatus.RUNNING and c is not other_than for c in self.children)


class ParallelSampling:
    """The scheduler's side of the groups: which completion may be admitted, on what blocks."""

    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self.groups: dict[str, SampleGroup] = {}     # request id -> group with unfinished children

    def add(self, seq: Sequence) -> None:
        if seq.group is not None:
            self.groups[seq.group.request_id] = seq.group

    @property
    def num_parked(self) -> int:
        return sum(len(g.parked) for g in self.groups.values())

    def child_ids(self, request_id: str) -> list[str]:
        """The unfinished completions of request `request_id` (none if it is no group)."""
        group = self.groups.get(request_id)
        return [] if group is None else [c.request_id for c in group.children if not c.is_finished]

    def publish_running(self) -> list[Sequence]:
        """At the start of a step: a group whose shared part a running completion has computed
        now holds it; returns the parked completions to put back at the head of the queue."""
        requeue: list[Sequence] = []
        for group in self.groups.values():
            if group.blocks is None and group.shared_len:
                seq = next((c for c in group.children if c.status == SequenceStatus.RUNNING
                            and c.num_computed_tokens >= group.shared_len), None)
                if seq is not None:
                    requeue += self._publish(group, seq)
        return requeue

    def must_wait(self, seq: Sequence) -> bool:
        """Whether `seq` should wait parked: a running sibling is computing the part it shares."""
        group = seq.group
        return (group is not None and group.shared_len > 0 and group.blocks is None
                and seq.num_computed_tokens == 0 and group.running())

    def unpark(self, seq: Sequence) -> bool:
        """Take a parked `seq` out of its group's parked list (False: it was not parked)."""
        if seq.group is None or seq not in seq.group.parked:
            return False
        seq.group.parked.remove(seq)
        return True

    def attach(self, seq: Sequence) -> bool:
        """Start `seq` on its group's shared blocks, if the group holds them (True: attached)."""
        group = seq.group
        if group is None or group.blocks is None or seq.num_computed_tokens:
            return False
        seq.block_table = self.block_manager.share(group.blocks)
        seq.num_computed_tokens = group.shared_len
        known = seq.prompt_logprobs
        if known is not None and group.prompt_logprobs is not None and len(known) < len(group.prompt_logprobs):
            seq.prompt_logprobs = list(group.prompt_logprobs)
        return True

    def detach(self, seq: Sequence) -> None:
        """Undo `attach` (the admission failed): `seq` waits again holding nothing."""
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0

    def leaving(self, seq: Sequence) -> list[Sequence]:
        """`seq` is about to free its blocks (preempted or finished). If it computed its group's
        shared part first, the group keeps it; if it was the sibling the parked ones waited for,
        they may go. Returns the completions to put back at the head of the queue."""
        group = seq.group
        if group is None or seq.status != SequenceStatus.RUNNING:
            return []
        if group.blocks is None and group.shared_len and seq.num_computed_tokens >= group.shared_len:
            return self._publish(group, seq)
        if group.parked and not group.running(other_than=seq):
            requeue, group.parked = group.parked, []
            return requeue
        return []

    def finished(self, seq: Sequence) -> None:
        """After `seq` finished: the last completion of a group releases the shared blocks."""
        group = seq.group
        if group is None or not all(c.is_finished for c in group.children):
            return
        if group.blocks is not None:
            self.block_manager.free(group.blocks)
        self.groups.pop(group.request_id, None)

    def drop_idle(self) -> bool:
        """Release the shared blocks of groups none of whose completions runs (the next one
        admitted computes them again); True if any were released. Called when the queue's head
        cannot be admitted and nothing runs that would free blocks."""
        dropped = False
        for group in self.groups.values():
            if group.blocks is not None and not group.running():
                self.block_manager.free(group.blocks)
                group.blocks = None
                dropped = True
        return dropped

    def _publish(self, group: SampleGroup, seq: Sequence) -> list[Sequence]:
        num_blocks = group.shared_len // self.block_manager.block_size
        group.blocks = self.block_manager.share(seq.block_table[:num_blocks])
        if seq.prompt_logprobs is not None:
            group.prompt_logprobs = list(seq.prompt_logprobs[:group.shared_len + 1])
        requeue, group.parked = group.parked, []
        return requeue
