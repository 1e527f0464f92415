"""Starting a DP group and driving it from rank 0.

`start_group` spawns ranks 1..N-1 on this machine (or, under torchrun, joins the ranks torchrun
started) and returns `DPEngine`: rank 0's engine plus the group, behind the interface of a single
`Engine` (add_request, abort, step, has_unfinished), so `LLM` and the server use it unchanged.
Requests are validated on rank 0 before routing, so a bad prompt is refused at once, as it would
be by one engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable

from dspark.config import EngineConfig
from dspark.distributed.comm import CollectiveError, GroupAddress, RankGroup, open_store
from dspark.distributed.data_parallel import Abort, Add, DPRank, Iteration, Stop
from dspark.distributed.failure import DPGroupError, GroupFailure, diagnose, exit_text
from dspark.distributed.router import Router
from dspark.engine.engine import Engine, EngineLoad
from dspark.engine.parallel_sampling import request_ids
from dspark.outputs import RequestOutput, SpecStats
from dspark.sampling_params import SamplingParams
from dspark.runner.step_key import StepKey

logger = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig, int], Engine]     # (config, rank) -> that rank's engine


def default_engine(config: EngineConfig, rank: int) -> Engine:
    return Engine(config)


class DPEngine:
    """Rank 0 of a DP group, driving it one lockstep iteration per `step()`."""

    def __init__(self, rank: DPRank, processes: dict[int, mp.process.BaseProcess]):
        self.dp_rank, self.group, self.local = rank, rank.group, rank.engine
        self.processes = processes                      # rank -> Process (ranks spawned here)
        self.router = Router(self.group.world_size)
        self.pending: list = []
        self._ids = itertools.count()
        self._fanned: dict[str, set[str]] = {}     # request (n > 1) -> its completions in flight
        self._parent: dict[str, str] = {}          # completion -> its request
        self._spec = [SpecStats() for _ in range(self.group.world_size)]
        self._runner: list[dict[str, int]] = []          # each rank's runner counters, last reported
        self._load = EngineLoad(0, 0, 0, 0)
        self.failure: GroupFailure | None = None
        self.last_rows: list | None = None               # every rank's LocalShape, last iteration
        # per non-idle step, only when a caller sets it to a list (a test inspecting invariant 7):
        # (key, live) as each rank reported running it, in rank order
        self.key_log: list[list[tuple[StepKey, bool]]] | None = None

    # the single-engine surface the server and LLM read
    tokenizer = property(lambda self: self.local.tokenizer)
    max_model_len = property(lambda self: self.local.max_model_len)
    config = property(lambda self: self.local.config)
    drafter = property(lambda self: self.local.drafter)
    model_config = property(lambda self: self.local.model_config)
    check_request = property(lambda self: self.local.check_request)

    @property
    def requests(self) -> dict[str, int]:
        return dict(self.router.owner)

    @property
    def has_unfinished(self) -> bool:
        return self.router.in_flight > 0 or bool(self.pending)

    @property
    def spec_stats(self) -> SpecStats:
        return SpecStats.total(self._spec)

    def load(self) -> EngineLoad:
        return self._load

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        self._check_running()
        params = params or SamplingParams()
        self.local.check_request(prompt, params)          # refused here, before routing
        request_id = request_id if request_id is not None else f"dp-{next(self._ids)}"
        ids = request_ids(request_id, params.n)       # n > 1: every completion on one rank
        if request_id in self.router.owner or any(i in self.router.owner for i in ids):
            raise ValueError(f"request id {request_id!r} is already running")
        rank = self.router.assign(ids[0])
        for child in ids[1:]:
            self.router.assign(child, rank)
        if len(ids) > 1:
            self._fanned[request_id] = set(ids)
            self._parent.update((child, request_id) for child in ids)
        self.pending.append(Add(rank, request_id, prompt, params, arrival_time or time.perf_counter()))
        return request_id

    def abort(self, request_id: str) -> bool:
        """A request (all its completions) or one completion, by its child id."""
        ranks = [self._release(i) for i in self._owned(request_id)]
        if not ranks:
            return False
        self.pending.append(Abort(ranks[0], request_id))
        return True

    def _owned(self, request_id: str) -> list[str]:
        """The router's ids of a request: its own, or those of its completions (n > 1)."""
        if request_id in self.router.owner:
            return [request_id]
        return sorted(self._fanned.get(request_id, ()))

    def _release(self, request_id: str) -> int | None:
        """One routed id is done (finished, aborted or refused); its rank, if it was routed."""
        parent = self._parent.pop(request_id, None)
        if parent is not None:
            left = self._fanned[parent]
            left.discard(request_id)
            if not left:
                del self._fanned[parent]
        return self.router.release(request_id)

    def step(self) -> list[RequestOutput]:
        self._check_running()
        commands, self.pending = self.pending, []
        it = self._iterate(commands)
        self.last_rows = it.rows
        if it.reports is not None:
            self._runner = [report.runner for report in it.reports]
        self._load = EngineLoad(sum(r.waiting for r in it.rows), sum(r.running for r in it.rows),
                                sum(r.free_blocks for r in it.rows), sum(r.num_blocks for r in it.rows),
                                _summed(self._runner))
        if it.reports is not None and not it.key.idle:
            self._check_keys(it)
        outputs = []
        for rank, report in enumerate(it.reports or []):
            self._spec[rank] = report.spec
            for request_id, why in report.rejected:
                logger.error("rank %d refused request %s: %s", rank, request_id, why)
                for i in self._owned(request_id):
                    self._release(i)
            outputs += report.outputs
        for out in outputs:
            if out.finished:
                self._release(out.request_id)
        return outputs

    def _iterate(self, commands: list) -> Iteration | None:
        """One lockstep iteration; any failure stops the group, naming the rank (DPGroupError)."""
        try:
            return self.dp_rank.iterate(commands)
        except CollectiveError as exc:
            self._fail(diagnose(self.group, self.processes, str(exc)))
        except Exception as exc:                      # rank 0's own engine failed
            logger.exception("rank 0 failed")
            self._fail(GroupFailure(0, f"raised: {type(exc).__name__}: {exc}"))

    @property
    def heartbeat_s(self) -> float:
        """How often an idle front end calls `heartbeat`: often enough that a rank lost while
        nothing runs is noticed within the group timeout, as one lost mid-step would be."""
        return min(5.0, self.group.timeout.total_seconds() / 4)

    def heartbeat(self) -> None:
        """Check the ranks while idle: without it a rank that dies between requests goes
        unnoticed until the next request, which then fails. A spawned rank's exit code names a
        death at once; one empty lockstep iteration finds a rank that is gone or stalled."""
        if self.failure is None and self.dp_rank.stopped:
            return                                    # closed: nothing left to watch
        self._check_running()
        for rank, process in sorted(self.processes.items()):
            if process.exitcode is not None:
                self._fail(GroupFailure(rank, f"died ({exit_text(process.exitcode)})"))
        it = self._iterate([])
        if it is not None:
            self.last_rows = it.rows

    def _check_keys(self, it) -> None:
        """Invariant 7, checked every step: every rank ran the key rank 0 ran."""
        ran = [(r.key, r.live) for r in it.reports]
        if self.key_log is not None:
            self.key_log.append(ran)
        for rank, (key, _) in enumerate(ran):
            if key != it.key:
                self._fail(GroupFailure(rank, f"ran graph key {key}, rank 0 ran {it.key}"))

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every rank and wait for the spawned ones."""
        if self.failure is None and not self.dp_rank.stopped:
            try:
                self.dp_rank.iterate([Stop("close")])
            except Exception:                          # noqa: BLE001 (closing a broken group)
                logger.warning("the group did not stop cleanly; terminating its processes")
        _reap(self.processes, timeout_s)

    @property
    def step_limit_s(self) -> float:
        """Rank 0's own step, peers' waits included, ends within two group timeouts or it hangs
        in rank 0 itself, where no collective timeout reaches (the server's watchdog asks)."""
        return 2 * self.group.timeout.total_seconds() + 5.0

    def stalled(self, age_s: float) -> DPGroupError:
        """Rank 0 hangs in its own step: stop the other ranks; the error names rank 0."""
        self.failure = GroupFailure(0, f"stalled: its own step has run {age_s:.1f} s, past "
                                       f"{self.step_limit_s:g} s")
        logger.error("%s; stopping the group", self.failure)
        _reap(self.processes, 0.0)
        return DPGroupError(self.failure)

    def _check_running(self) -> None:
        if self.failure is not None:
            raise DPGroupError(self.failure)
        if self.dp_rank.stopped:
            raise RuntimeError("the data-parallel group is closed")

    def _fail(self, failure: GroupFailure):
        self.failure = failure
        logger.error("%s; stopping the group", failure)
        _reap(self.processes, 0.0)
        raise DPGroupError(failure)


def start_group(config: EngineConfig, engine_factory: EngineFactory = default_engine) -> DPEngine:
    """Spawn ranks 1..N-1 here, become rank 0, and wait until every rank has captured."""
    config = split_threads(config, config.parallel.data_parallel_size)
    par = config.parallel
    address = GroupAddress(par.dp_host, par.dp_port, par.data_parallel_size)
    store, address.port = open_store(address, 0, par.dp_startup_timeout_s)
    spawn = mp.get_context("spawn")
    processes = {}
    for r in range(1, par.data_parallel_size):
        processes[r] = spawn.Process(target=rank_main, args=(config, r, address, engine_factory),
                                     name=f"dspark-dp-rank{r}", daemon=True)
        processes[r].start()
    try:
        return lead_group(config, store, processes, engine_factory)
    except BaseException:
        _reap(processes, 0.0)
        raise


def split_threads(config: EngineConfig, local_ranks: int) -> EngineConfig:
    """Ranks on one CPU share its cores: without --threads each gets cores / local ranks, not
    torch's default of all of them (which oversubscribes the machine N times)."""
    if config.num_threads is not None or config.device != "cpu" or local_ranks <= 1:
        return config
    threads = max(1, (os.cpu_count() or 1) // local_ranks)
    logger.info("%d data-parallel ranks on this CPU: %d threads each", local_ranks, threads)
    return dataclasses.replace(config, num_threads=threads)


def rank_device(config: EngineConfig, local_rank: int) -> EngineConfig:
    """A rank's own GPU: with `--device cuda` and several data-parallel ranks, rank i of a host
    takes `cuda:i`. Otherwise every replica would land on GPU 0 and size its KV cache from the
    whole card."""
    n = config.parallel.data_parallel_size
    if not config.device.startswith("cuda") or n <= 1:
        return config
    if config.device != "cuda":
        raise ValueError(f"with --dp {n} each rank takes the GPU of its local rank: pass "
                         f"--device cuda, not {config.device!r}")
    return dataclasses.replace(config, device=f"cuda:{local_rank}")


def lead_group(config: EngineConfig, store, processes: dict,
               engine_factory: EngineFactory = default_engine) -> DPEngine:
    """Rank 0: wait for the peers to join, build the engine, wait until every rank captured."""
    par = config.parallel
    await_ranks(store, "joined", par.data_parallel_size, processes, par.dp_startup_timeout_s)
    group = RankGroup(store, 0, par.data_parallel_size, par.dp_timeout_s)
    engine = engine_factory(rank_device(config, 0), 0)
    await_ranks(store, "ready", par.data_parallel_size, processes, par.dp_startup_timeout_s)
    logger.info("data-parallel group of %d ranks ready", par.data_parallel_size)
    return DPEngine(DPRank(engine, group), processes)


def rank_main(config: EngineConfig, rank: int, address: GroupAddress,
              engine_factory: EngineFactory = default_engine) -> None:
    """A spawned rank: join rank 0's store, then serve as a follower until told to stop."""
    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(levelname)s %(name)s: %(message)s")
    store, _ = open_store(address, rank, config.parallel.dp_startup_timeout_s)
    follow_group(config, store, rank, engine_factory)


def follow_group(config: EngineConfig, store, rank: int,
                 engine_factory: EngineFactory = default_engine) -> None:
    """Ranks 1..N-1: build the engine, then iterate until rank 0 says stop. Exits the process
    non-zero on failure, leaving the cause in the store for rank 0 to name."""
    par = config.parallel
    store.set(f"joined/{rank}", "1")
    group = RankGroup(store, rank, par.data_parallel_size, par.dp_timeout_s)
    try:
        engine = engine_factory(rank_device(config, rank), rank)
        group.mark("ready")
        dp = DPRank(engine, group)
        while not dp.stopped:
            dp.iterate()
    except CollectiveError as exc:            # a peer broke: rank 0 names it; just leave
        logger.error("rank %d leaves the group: %s", rank, exc)
        os._exit(3)
    except BaseException as exc:              # this rank broke: say why where rank 0 looks
        logger.exception("rank %d failed", rank)
        group.report_error(f"{type(exc).__name__}: {exc}")
        os._exit(1)


def await_ranks(store, name: str, world_size: int, processes: dict, timeout_s: float) -> None:
    """Rank 0 waits for every rank to reach a start-up mark; a rank that raised, died or did
    not come in time is named (DPGroupError) instead of waited on forever."""
    deadline = time.monotonic() + timeout_s
    missing = set(range(1, world_size))
    while missing:
        missing = {r for r in missing if not store.check([f"{name}/{r}"])}
        for r in sorted(missing):
            if store.check([f"error/{r}"]):
                raise DPGroupError(GroupFailure(r, f"raised during start-up: {store.get(f'error/{r}').decode()}"))
            p = processes.get(r)
            if p is not None and p.exitcode is not None:
                raise DPGroupError(GroupFailure(r, f"died during start-up (exit code {p.exitcode})"))
        if missing and time.monotonic() > deadline:
            raise DPGroupError(GroupFailure(min(missing), f"was not {name} within {timeout_s:g} s"))
        time.sleep(0.05)


def _reap(processes: dict, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in processes.values():
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)


def _summed(counters: list[dict[str, int]]) -> dict[str, int]:
    """The ranks' runner counters added up, name by name."""
    total: dict[str, int] = {}
    for rank in counters:
        for name, value in rank.items():
            total[name] = total.get(name, 0) + value
    return total
