"""The idle engine thread's heartbeat, over a stub engine: it beats every `heartbeat_s` while
nothing runs, a failed beat stops the server like a failed step, and an engine without a
heartbeat (one Engine) sleeps until a request comes."""

from __future__ import annotations

import asyncio
import time

from dspark.engine.engine import EngineStopped
from dspark.server.async_engine import AsyncEngine


class IdleEngine:
    """Just what the engine thread touches while idle; its heartbeat fails at `fail_at`."""

    step_limit_s = None
    has_unfinished = False

    def __init__(self, heartbeat_s: float | None, fail_at: int | None = None):
        self.heartbeat_s = heartbeat_s
        self.fail_at = fail_at
        self.beats: list[float] = []

    def heartbeat(self) -> None:
        self.beats.append(time.monotonic())
        if len(self.beats) == self.fail_at:
            raise EngineStopped("data-parallel rank 1 died (killed by SIGKILL)")


async def idle_for(engine: IdleEngine, seconds: float) -> list[BaseException]:
    fatal: list[BaseException] = []
    async_engine = AsyncEngine(engine, on_fatal=fatal.append)
    async_engine.start()
    await asyncio.sleep(seconds)
    assert async_engine.is_running == (not fatal)
    await async_engine.stop()
    return fatal


def test_an_idle_engine_beats_and_a_failed_beat_is_fatal():
    engine = IdleEngine(heartbeat_s=0.05, fail_at=4)
    fatal = asyncio.run(idle_for(engine, 1.0))
    assert len(engine.beats) == 4                           # none after the failure
    gaps = [b - a for a, b in zip(engine.beats, engine.beats[1:])]
    assert all(0.04 < gap < 0.5 for gap in gaps), gaps
    assert len(fatal) == 1 and "rank 1 died" in str(fatal[0])


def test_no_heartbeat_without_an_interval():
    engine = IdleEngine(heartbeat_s=None)
    assert asyncio.run(idle_for(engine, 0.3)) == []
    assert engine.beats == []
