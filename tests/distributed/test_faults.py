"""The failure policy: a rank that raises, dies or stalls ends the group within the timeout, named."""

import functools
import time

import pytest

from dspark import SamplingParams
from dspark.distributed.failure import DPGroupError
from dspark.distributed.group import start_group
from dspark.llm import build_config
from dp_helpers import faulty_engine
from test_data_parallel import engine_kwargs, models  # noqa: F401 (the models fixture)

TIMEOUT = 4.0


def start(models, fault=None, after=2):  # noqa: F811
    config = build_config(**engine_kwargs(models, data_parallel_size=2, dp_timeout_s=TIMEOUT))
    factory = functools.partial(faulty_engine, fault, 1, after) if fault else None
    return start_group(config, factory) if factory else start_group(config)


def decode_until_failure(engine, limit_s=60.0):
    """Two long requests (one per rank), stepped until the group fails; returns (error, seconds
    from the last good step to the error)."""
    for i in range(2):
        engine.add_request([5, 6, 7, 8, 9 + i], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        last_good = time.monotonic()
        try:
            engine.step()
        except DPGroupError as exc:
            return exc, time.monotonic() - last_good
    raise AssertionError("the group never failed")


def test_rank_raising_during_capture(models):  # noqa: F811
    t0 = time.monotonic()
    with pytest.raises(DPGroupError, match=r"rank 1 raised during start-up: RuntimeError: injected capture failure"):
        start(models, "capture")
    assert time.monotonic() - t0 < 60


def test_rank_raising_mid_decode(models):  # noqa: F811
    engine = start(models, "raise")
    try:
        exc, seconds = decode_until_failure(engine)
    finally:
        engine.close(timeout_s=5)
    assert "rank 1 raised: RuntimeError: injected step failure" in str(exc)
    assert seconds < TIMEOUT + 2
    with pytest.raises(DPGroupError):                      # a stopped group refuses new work
        engine.add_request([5, 6], SamplingParams(max_tokens=2))


def test_rank_killed_mid_decode(models):  # noqa: F811
    engine = start(models)
    try:
        for i in range(2):
            engine.add_request([5, 6, 7, 8, 9 + i], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        for _ in range(3):
            engine.step()
        engine.processes[1].kill()
        t0 = time.monotonic()
        with pytest.raises(DPGroupError, match=r"rank 1 died \(killed by SIGKILL\)"):
            for _ in range(200):
                engine.step()
        assert time.monotonic() - t0 < TIMEOUT + 2
    finally:
        engine.close(timeout_s=5)


def test_rank_stalling(models):  # noqa: F811
    engine = start(models, "stall")
    try:
        exc, seconds = decode_until_failure(engine)
    finally:
        engine.close(timeout_s=5)
    assert "rank 1 stalled" in str(exc)
    assert TIMEOUT - 0.5 < seconds < TIMEOUT + 3
    assert not engine.processes[1].is_alive()              # the stalled rank was stopped too


def test_an_idle_group_outlives_the_step_timeout(models):  # noqa: F811
    """Followers wait for rank 0's next command without the step timeout: a quiet front end is
    not a stalled rank."""
    engine = start(models)
    try:
        time.sleep(TIMEOUT + 1.5)
        engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        finished = []
        while engine.has_unfinished:
            finished += [o for o in engine.step() if o.finished]
        assert len(finished) == 1 and len(finished[0].token_ids) == 5
    finally:
        engine.close(timeout_s=10)
    assert engine.processes[1].exitcode == 0
