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

pytestmark = pytest.mark.slow          # every test starts a group of processes (seconds)

TIMEOUT = 4.0


def start(models, fault=None, after=2):  # noqa: F811
    config = build_config(**engine_kwargs(models, data_parallel_size=2, dp_timeout_s=TIMEOUT))
    factory = functools.partial(faulty_engine, fault, 1, after) if fault else None
    return start_group(config, factory) if factory else start_group(config)


def add_long_requests(engine):
    """Two long requests, one per rank."""
    for i in range(2):
        engine.add_request([5, 6, 7, 8, 9 + i], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))


def decode_until_failure(engine, limit_s=60.0, kill_after: int | None = None):
    """Two long requests stepped until the group fails (rank 1's process killed after
    `kill_after` steps, if given); returns (error, seconds from the last good step to it)."""
    add_long_requests(engine)
    steps = 0
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if steps == kill_after:
            engine.processes[1].kill()
        steps += 1
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


@pytest.mark.parametrize("fault,kill_after,message,min_s,max_s", [
    ("raise", None, "rank 1 raised: RuntimeError: injected step failure", 0.0, TIMEOUT + 2),
    (None, 3, "rank 1 died (killed by SIGKILL)", 0.0, TIMEOUT + 2),
    ("stall", None, "rank 1 stalled", TIMEOUT - 0.5, TIMEOUT + 3),     # found by the timeout
])
def test_a_failing_rank_stops_the_group_named(models, fault, kill_after, message, min_s, max_s):  # noqa: F811
    engine = start(models, fault)
    try:
        exc, seconds = decode_until_failure(engine, kill_after=kill_after)
    finally:
        engine.close(timeout_s=5)
    assert message in str(exc)
    assert min_s < seconds < max_s
    assert not engine.processes[1].is_alive()              # every rank is stopped
    with pytest.raises(DPGroupError):                      # and the group refuses new work
        engine.add_request([5, 6], SamplingParams(max_tokens=2))


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
