"""Step agreement (pure): every rank derives one key that holds every rank's step."""

import random

import pytest

from dspark.distributed.agreement import LocalShape, agree, captured_mask, table_bucket
from dspark.distributed.router import Router
from dspark.runner.graphs import token_buckets

TOKENS = token_buckets(512)
REQUESTS = token_buckets(64)


def random_rank(rng: random.Random) -> LocalShape:
    if rng.random() < 0.3:
        return LocalShape(captured_mask=captured_mask(TOKENS, set(TOKENS)))
    live = rng.randint(1, 64)
    drafts = rng.randint(0, live)
    return LocalShape(live_reqs=live, tokens=rng.randint(live, 700), draft_reqs=drafts,
                      table_width=rng.randint(1, 300),
                      captured_mask=captured_mask(TOKENS, {b for b in TOKENS if rng.random() < 0.95}))


def test_roundtrip():
    shape = LocalShape(status=0, live_reqs=3, tokens=17, draft_reqs=2, table_width=9, captured_mask=5,
                       waiting=1, running=3, free_blocks=100, num_blocks=128, rejected=1)
    assert LocalShape.decode(shape.encode()) == shape
    assert len(shape.encode()) == LocalShape.width()


@pytest.mark.parametrize("world", [2, 3, 8])
def test_random_topologies(world):
    rng = random.Random(world)
    for _ in range(2000):
        rows = [random_rank(rng) for _ in range(world)]
        # each rank computes the key from the gathered table in rank order: one answer for all
        keys = {agree(list(rows), TOKENS, REQUESTS) for _ in range(world)}
        assert len(keys) == 1
        key = keys.pop()
        if all(r.live_reqs == 0 for r in rows):
            assert key.idle
            continue
        most = max(r.tokens for r in rows)
        if most > TOKENS[-1]:
            assert key.tokens is None and not key.captured
        else:
            assert key.tokens >= most
            assert key.tokens == min(b for b in TOKENS if b >= most)        # the smallest that holds it
            bit = TOKENS.index(key.tokens)
            assert key.captured == all(r.captured_mask >> bit & 1 for r in rows)
        most_drafts = max(r.draft_reqs for r in rows)
        assert (key.draft_reqs == 0) == (most_drafts == 0)
        assert key.draft_reqs >= most_drafts
        assert key.table_width >= max(r.table_width for r in rows)
        assert key.table_width & (key.table_width - 1) == 0                   # a power of two


def test_idle_ranks_join_a_busy_peer():
    busy = LocalShape(live_reqs=2, tokens=10, draft_reqs=2, table_width=3, captured_mask=captured_mask(TOKENS, {16}))
    idle = LocalShape(captured_mask=captured_mask(TOKENS, {16}))
    key = agree([idle, busy, idle], TOKENS, REQUESTS)
    assert not key.idle and key.tokens == 16 and key.draft_reqs == 2 and key.captured
    assert table_bucket(3) == 16 and table_bucket(17) == 32


def test_capture_presence_must_be_unanimous():
    a = LocalShape(live_reqs=1, tokens=1, captured_mask=captured_mask(TOKENS, {1}))
    b = LocalShape(live_reqs=1, tokens=1, captured_mask=0)        # its capture fell back to eager
    assert not agree([a, b], TOKENS, REQUESTS).captured
    assert agree([a, a], TOKENS, REQUESTS).captured


def test_a_failing_row_is_not_agreed_on():
    with pytest.raises(ValueError, match="every rank is OK"):
        agree([LocalShape(status=2), LocalShape()], TOKENS, REQUESTS)


def test_router_least_loaded():
    router = Router(3)
    assert [router.assign(f"r{i}") for i in range(5)] == [0, 1, 2, 0, 1]
    router.release("r0")
    router.release("r3")                    # rank 0 now has nothing in flight
    assert router.assign("r5") == 0
    with pytest.raises(ValueError, match="already running"):
        router.assign("r5")
    assert router.release("unknown") is None
    assert router.in_flight == 4


def test_ranks_on_one_cpu_split_its_cores():
    import dataclasses
    import os

    from dspark.config import EngineConfig
    from dspark.distributed.group import split_threads
    config = EngineConfig()
    cores = os.cpu_count()
    assert split_threads(config, 2).num_threads == max(1, cores // 2)
    assert split_threads(config, 1).num_threads is None                    # one rank: torch decides
    explicit = dataclasses.replace(config, num_threads=3)
    assert split_threads(explicit, 2).num_threads == 3                     # --threads wins


def test_each_data_parallel_rank_takes_its_own_gpu(monkeypatch):
    """`--device cuda --dp N`: rank i of a host on cuda:i (torchrun's LOCAL_RANK where it
    launched them), not every replica on GPU 0; a pinned device cannot serve several ranks."""
    import dataclasses

    import pytest

    from dspark.config import EngineConfig, ParallelConfig
    from dspark.distributed.group import rank_device
    two = dataclasses.replace(EngineConfig(device="cuda"), parallel=ParallelConfig(data_parallel_size=2))
    assert [rank_device(two, r).device for r in (0, 1)] == ["cuda:0", "cuda:1"]
    assert rank_device(EngineConfig(device="cuda"), 0).device == "cuda"          # one rank: as given
    assert rank_device(dataclasses.replace(two, device="cpu"), 1).device == "cpu"
    with pytest.raises(ValueError, match="--device cuda"):
        rank_device(dataclasses.replace(two, device="cuda:1"), 0)
