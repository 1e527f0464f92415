"""`dspark serve --dp 2`: serves through two ranks; when a rank dies the server answers 503 and
exits non-zero instead of hanging, and an idle server notices the death too (its heartbeat)."""

import os
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from tiny_server import launched

CLI = "from dspark.cli import main; main()"


pytestmark = pytest.mark.slow          # every test starts a group of processes (seconds)


def rank_processes(pid: int) -> list[int]:
    """The server's spawned rank processes (not multiprocessing's resource tracker)."""
    children = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            children += [int(c) for c in f.read().split()]
    ranks = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                ranks.append(child)
    return ranks


def running_requests(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("dspark_num_requests_running "):
                return float(line.split()[1])
    return 0.0


@pytest.fixture
def dp_server(target_dir, drafter_dir):
    with launched(CLI, "--model", target_dir, "--drafter", drafter_dir, "--dtype", "float32",
                  "--graph", "eager", "--dp", "2", "--dp-timeout", "4", "--threads", "1",
                  "--max-model-len", "256") as served:
        yield served


def test_rank_death_answers_503_and_exits_nonzero(dp_server):
    proc, url = dp_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    first = client.completions.create(model=client.models.list().data[0].id, prompt="w1 w2 w3",
                                      max_tokens=8, extra_body={"ignore_eos": True})
    assert first.usage.completion_tokens == 8
    ranks = rank_processes(proc.pid)
    assert len(ranks) == 1

    results = []

    def long_request():
        try:
            client.completions.create(model=first.model, prompt="w4 w5", max_tokens=240,
                                      extra_body={"ignore_eos": True})
            results.append((200, ""))
        except openai.APIStatusError as exc:
            results.append((exc.status_code, str(exc)))

    threads = [threading.Thread(target=long_request) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while running_requests(url) < 1:          # kill only once requests are decoding
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.01)
    os.kill(ranks[0], 9)
    for t in threads:
        t.join(30)
    failed = [(status, message) for status, message in results if status != 200]
    assert len(results) == 4 and failed, results
    assert all(status == 503 and "rank 1" in message for status, message in failed), failed
    assert proc.wait(timeout=30) == 1                       # the server exits non-zero
    log = proc.stdout.read()
    assert "data-parallel rank 1 died" in log


def test_an_idle_server_notices_a_dead_rank(dp_server):
    """No request needs to come: the idle engine thread's heartbeat finds the dead rank (and
    beats past the timeout harmlessly while every rank is alive)."""
    proc, url = dp_server
    ranks = rank_processes(proc.pid)
    assert len(ranks) == 1
    time.sleep(4 + 2)                                       # idle past --dp-timeout: still serving
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    done = client.completions.create(model=client.models.list().data[0].id, prompt="w1 w2",
                                     max_tokens=4, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 4 and proc.poll() is None
    os.kill(ranks[0], 9)
    killed = time.monotonic()
    assert proc.wait(timeout=4 + 10) == 1                   # --dp-timeout 4, plus start-up slack
    assert time.monotonic() - killed < 4 + 3                # within the timeout plus a margin
    assert "data-parallel rank 1 died" in proc.stdout.read()


def stall_rank0_engine(config, rank):
    """Rank 0's engine hangs in its own compute from its third step on (nothing times out there)."""
    from dspark.engine.engine import Engine
    engine = Engine(config)
    if rank == 0:
        execute, count = engine.worker.execute, [0]

        def hang(*args, **kwargs):
            count[0] += 1
            if count[0] > 2:
                time.sleep(3600)
            return execute(*args, **kwargs)
        engine.worker.execute = hang
    return engine


def test_rank0_stalling_in_its_own_step_answers_503(target_dir, drafter_dir):
    from dspark.distributed.group import start_group
    from dspark.llm import build_config
    from dspark.server import ServerThread, build_app
    config = build_config(model=target_dir, drafter=drafter_dir, dtype="float32", graph="eager",
                          max_model_len=256, data_parallel_size=2, dp_timeout_s=2.0)
    engine = start_group(config, stall_rank0_engine)
    fatal = []
    server = ServerThread(build_app(engine, on_fatal=fatal.append)).start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=model, prompt="w1 w2",
                                      max_tokens=50, extra_body={"ignore_eos": True})
        assert err.value.status_code == 503
        assert "rank 0 stalled" in str(err.value)
        assert time.monotonic() - t0 < engine.step_limit_s + 5
        assert fatal and "rank 0 stalled" in str(fatal[0])
        assert not engine.processes[1].is_alive()          # the follower was stopped
        with pytest.raises(openai.APIStatusError) as again:  # and nothing new is accepted
            client.completions.create(model=model, prompt="w1", max_tokens=2)
        assert again.value.status_code == 503
    finally:
        server.stop(timeout=10)
