"""Data parallelism: N engine replicas stepping in lockstep as one group.

Every iteration of every rank is the same four moves: (1) rank 0 broadcasts the commands the
front end queued (adds routed to a rank, aborts, stop); (2) each rank plans its own step, budget
included, and the ranks agree on its shape in one all-gather (agreement.py); (3) each rank runs
the agreed key, live rows padded, an idle rank as a complete dummy query; (4) the outputs are
gathered on rank 0, which streams them to the clients. Lockstep is what makes the agreement
possible; its price is a few small collectives per step (docs/measurements.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dspark.distributed.agreement import FAILED, OK, STOPPING, LocalShape, agree, captured_mask
from dspark.distributed.comm import RankGroup
from dspark.engine.engine import Engine
from dspark.outputs import RequestOutput, SpecStats
from dspark.sampling_params import SamplingParams
from dspark.runner.graphs import token_buckets
from dspark.runner.step_key import StepKey

logger = logging.getLogger(__name__)


@dataclass
class Add:
    rank: int
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float | None


@dataclass
class Abort:
    rank: int
    request_id: str


@dataclass
class Stop:
    reason: str


Command = Add | Abort | Stop


@dataclass
class RankReport:
    """What a rank sends rank 0 after a step."""
    key: StepKey                                 # the key this rank ran (rank 0 checks they match)
    live: bool                                   # False: it ran the key as a dummy query
    outputs: list[RequestOutput]
    spec: SpecStats
    rejected: list[tuple[str, str]] = field(default_factory=list)   # (request id, why)
    runner: dict[str, int] = field(default_factory=dict)            # its RunnerStats.counters()


@dataclass
class Iteration:
    """One lockstep iteration as rank 0 sees it."""
    key: StepKey
    rows: list[LocalShape]                       # every rank's reported shape
    reports: list[RankReport] | None             # every rank's outputs (None when idle)


class DPRank:
    """One rank's side of the lockstep loop around its own engine."""

    def __init__(self, engine: Engine, group: RankGroup):
        self.engine, self.group = engine, group
        graphs = engine.worker.runner.graphs
        self.token_buckets = graphs.buckets
        drafts = engine.worker.runner.draft_graphs
        self.request_buckets = (drafts.buckets if drafts is not None
                                else token_buckets(engine.config.scheduler.max_num_seqs))
        captured = {b for b, r in graphs.runners.items() if r is not None}
        self.captured_mask = captured_mask(self.token_buckets, captured)
        self.stopped = False
        # between steps a follower waits on rank 0's front end, which may be idle for long
        self.follower_wait_s = engine.config.parallel.dp_idle_wait_s

    def iterate(self, commands: list[Command] | None = None) -> Iteration | None:
        """One lockstep iteration (rank 0 passes the commands; None once the group stopped)."""
        commands = self.group.broadcast_object(commands or [], "commands", self.follower_wait_s)
        rejected = self._apply(commands)
        stopping = any(isinstance(c, Stop) for c in commands)
        prepared = None if stopping else self.engine.prepare_step()
        rows = [LocalShape.decode(r) for r in
                self.group.allgather_ints(self._shape(prepared, stopping, len(rejected)).encode(), "agree")]
        if any(r.status == STOPPING for r in rows):
            self.stopped = True
            return None
        failed = [i for i, r in enumerate(rows) if r.status == FAILED]
        if failed:
            raise RuntimeError(f"rank {failed[0]} reported a failure")
        key = agree(rows, self.token_buckets, self.request_buckets)
        if key.idle:        # gather only to report refused adds (every rank sees the counts)
            if not any(r.rejected for r in rows):
                return Iteration(key, rows, None)
            report = RankReport(key, False, [], self.engine.spec_stats, rejected, self._runner())
            return Iteration(key, rows, self.group.gather_objects(report, "outputs"))
        if prepared is not None:
            outputs = self.engine.run_step(prepared, key)
        else:
            self.engine.worker.dummy_step(key)
            outputs = []
        report = RankReport(key, prepared is not None, outputs, self.engine.spec_stats, rejected,
                            self._runner())
        return Iteration(key, rows, self.group.gather_objects(report, "outputs"))

    def _runner(self) -> dict[str, int]:
        return self.engine.worker.runner.stats().counters()

    def _apply(self, commands: list[Command]) -> list[tuple[str, str]]:
        """This rank's adds and aborts; an add its engine refuses is reported back, not raised."""
        rejected = []
        for c in commands:
            if isinstance(c, Add) and c.rank == self.group.rank:
                try:
                    self.engine.add_request(c.prompt, c.params, c.request_id, arrival_time=c.arrival_time)
                except (ValueError, TypeError) as exc:
                    rejected.append((c.request_id, str(exc)))
            elif isinstance(c, Abort) and c.rank == self.group.rank:
                self.engine.abort(c.request_id)
        return rejected

    def _shape(self, prepared, stopping: bool, rejected: int) -> LocalShape:
        blocks = self.engine.block_manager
        shape = LocalShape(status=STOPPING if stopping else OK, captured_mask=self.captured_mask,
                           rejected=rejected,
                           waiting=self.engine.scheduler.num_waiting,
                           running=len(self.engine.scheduler.running),
                           free_blocks=blocks.num_free_blocks, num_blocks=blocks.num_blocks)
        if prepared is not None:
            reqs, tokens, drafts, width = self.engine.worker.step_shape(prepared.batch)
            shape.live_reqs, shape.tokens, shape.draft_reqs, shape.table_width = reqs, tokens, drafts, width
        return shape

