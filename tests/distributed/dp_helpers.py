"""Engines for the DP tests: per-rank configs and injected faults. Module-level (picklable) so a
spawned rank can build them."""

import dataclasses
import os
import time

from dspark.engine.engine import Engine


def engine_with_blocks(kv_bytes_by_rank: dict, config, rank: int) -> Engine:
    """Ranks with different KV budgets (page counts)."""
    if rank in kv_bytes_by_rank:
        cache = dataclasses.replace(config.cache, kv_cache_bytes=kv_bytes_by_rank[rank])
        config = dataclasses.replace(config, cache=cache)
    return Engine(config)


def faulty_engine(fault: str, fault_rank: int, after_steps: int, config, rank: int) -> Engine:
    """`fault` on `fault_rank`: "capture" raises while building; "raise", "stall" and "exit"
    strike in the worker after `after_steps` steps."""
    if rank == fault_rank and fault == "capture":
        raise RuntimeError("injected capture failure")
    engine = Engine(config)
    if rank != fault_rank:
        return engine
    worker, execute, count = engine.worker, engine.worker.execute, [0]

    def strike(*args, **kwargs):
        count[0] += 1
        if count[0] > after_steps:
            if fault == "raise":
                raise RuntimeError("injected step failure")
            if fault == "stall":
                time.sleep(3600)
            if fault == "exit":
                os._exit(7)
        return execute(*args, **kwargs)

    worker.execute = strike
    return engine
