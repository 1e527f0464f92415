"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

Every step is one mixed batch: running requests first (a decode token, or the next chunk of a
prefill), then waiting requests while budget, sequence slots and KV blocks last.  When a running
request cannot grow, the most recently admitted one is preempted by recompute: its blocks are
freed and it re-enters the queue at the front, to be prefilled again over prompt + output.
The n completions of one request (n > 1) start on the prompt blocks the first one computed
(parallel_sampling.py decides which waits, which attaches, and what the group keeps).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from dspark.config import SchedulerConfig
from dspark.engine.block_manager import BlockManager
from dspark.engine.parallel_sampling import ParallelSampling
from dspark.engine.sequence import Sequence, SequenceStatus
from dspark.spec.planner import StepPlan
from dspark.spec.policy import Candidate, SpecPolicy, StepContext

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    seq: Sequence
    num_new_tokens: int            # tokens whose KV this step computes
    sample: bool                   # the chunk reaches the end of the known tokens: sample after it
    spec: bool = False             # a speculative step: anchor + verify_len drafts
    verify_len: int = 0            # ℓ: drafts verified this step (the drafter still drafts γ)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    plan: StepPlan | None = None   # the speculation policy's plan (None: every draft verified)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 num_spec_tokens: int = 0):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.num_spec_tokens = num_spec_tokens      # γ; 0 = plain decoding
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.policy: SpecPolicy | None = None       # None: every speculative request verifies all
        self.parallel = ParallelSampling(block_manager)    # completions sharing a prompt (n > 1)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.parallel.add(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued, or parked until a sibling computed their shared prompt."""
        return len(self.waiting) + self.parallel.num_parked

    def schedule(self, only: Sequence | None = None) -> SchedulerOutput:
        """Running requests first (decode, speculative blocks, prefill chunks), then waiting ones
        with the token budget left. The speculation policy sees the running requests before any
        waiting request is admitted; a speculative block it leaves undrafted becomes one plain
        token, so the tokens it gives back go to prefill. `only`: that running request alone,
        nothing admitted (the engine runs the requests of a failed step one at a time)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.waiting.extendleft(reversed(self.parallel.publish_running()))     # at the head, in order
        for seq in list(self.running) if only is None else [only]:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue            # preempted earlier in this loop
            item = self._plan(seq, budget)
            if not self._grow_or_preempt(seq, item.num_new_tokens):
                continue
            out.scheduled.append(item)
            budget -= item.num_new_tokens
        if self.policy is not None and any(s.spec for s in out.scheduled):
            out.plan = self._plan_speculation(out.scheduled)
            budget = self.config.max_num_batched_tokens - sum(s.num_new_tokens for s in out.scheduled)
        if only is None:
            self._admit_waiting(out, budget)
        return out

    def _plan_speculation(self, scheduled: list[ScheduledRequest]) -> StepPlan:
        """Ask the policy which speculative requests draft; the others decode one plain token and
        the blocks reserved for their drafts go back at once. The policy also gets the prompt
        tokens the waiting requests would add were nothing drafted: the step it prices drafts on."""
        spec = [s for s in scheduled if s.spec]
        plain = sum(1 if s.spec else s.num_new_tokens for s in scheduled)
        step = StepContext(other_tokens=plain, num_sampling=sum(1 for s in scheduled if s.sample),
                           joining_tokens=self._joining_tokens(self.config.max_num_batched_tokens - plain))
        candidates = [Candidate(s.seq.request_id, s.verify_len, s.seq.num_computed_tokens,
                                self._remaining(s.seq)) for s in spec]
        plan = self.policy.plan(candidates, step)
        for s, drafted in zip(spec, plan.drafted):
            if not drafted:
                s.spec, s.verify_len, s.num_new_tokens = False, 0, 1
                self.block_manager.truncate(s.seq.block_table, s.seq.num_computed_tokens + 1)
                s.seq.spec.undrafted_steps += 1
        return plan

    def _remaining(self, seq: Sequence) -> int:
        """Tokens the request may still generate."""
        return min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)

    def _joining_tokens(self, budget: int) -> int:
        """The prompt tokens the waiting requests would bring with `budget` tokens left (sequence
        slots counted, KV blocks not: an estimate for pricing, made before the planner runs)."""
        free = max(0, self.config.max_num_seqs - len(self.running))
        wanted = sum(seq.num_tokens - seq.num_computed_tokens for seq in itertools.islice(self.waiting, free))
        return min(wanted, max(0, budget))

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.parallel.must_wait(seq):        # a sibling is computing the prompt they share
                seq.group.parked.append(self.waiting.popleft())
                continue
            attached = self.parallel.attach(seq)
            item = self._plan(seq, budget)
            if not self.block_manager.ensure(seq.block_table, seq.num_computed_tokens + item.num_new_tokens):
                if attached:
                    self.parallel.detach(seq)
                if not self.running and self.parallel.drop_idle():
                    continue                        # idle groups' shared prompts held the room
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            out.scheduled.append(item)
            budget -= item.num_new_tokens

    def _plan(self, seq: Sequence, budget: int) -> ScheduledRequest:
        """A prefill chunk, a plain decode token, or a speculative step (anchor + ℓ drafts)."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        if self.num_spec_tokens and remaining == 1 and seq.num_output_tokens > 0:
            verify_len = max(0, min(self.num_spec_tokens, budget - 1,
                                    seq.params.max_tokens - seq.num_output_tokens - 1,
                                    self.max_model_len - seq.num_tokens))
            return ScheduledRequest(seq, 1 + verify_len, sample=True, spec=True, verify_len=verify_len)
        n = min(remaining, budget)
        return ScheduledRequest(seq, n, sample=seq.num_computed_tokens + n == seq.num_tokens)

    def _grow_or_preempt(self, seq: Sequence, n: int) -> bool:
        need = seq.num_computed_tokens + n
        while not self.block_manager.ensure(seq.block_table, need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        requeue = self.parallel.leaving(seq)
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.extendleft(reversed([seq, *requeue]))
        logger.debug("preempted %s (recompute)", seq.request_id)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finished or aborted: release the KV blocks at once."""
        requeue = self.parallel.leaving(seq)
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and not self.parallel.unpark(seq):
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.parallel.finished(seq)
        self.waiting.extendleft(reversed(requeue))
        if self.policy is not None:
            self.policy.forget(seq.request_id)
        seq.metrics.finished_time = time.perf_counter()
