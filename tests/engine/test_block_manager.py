"""Property tests: after any mix of finished, aborted and preempted requests every block is free."""

import random

import pytest

from dspark.engine.block_manager import BlockManager


def test_ensure_is_all_or_nothing():
    bm = BlockManager(4, 4)
    table = []
    assert bm.ensure(table, 10) and len(table) == 3
    other = []
    assert not bm.ensure(other, 8) and other == [] and bm.num_free_blocks == 1
    bm.truncate(table, 5)
    assert len(table) == 2 and bm.num_free_blocks == 2


def test_share_and_double_free():
    bm = BlockManager(4, 2)
    table = []
    bm.ensure(table, 4)
    fork = bm.share(table)
    bm.free(table)
    assert bm.num_free_blocks == 2           # still owned by the fork
    bm.free(fork)
    assert bm.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        bm._release(0)


def test_released_blocks_are_reported_once_and_only_when_their_last_owner_frees_them():
    bm = BlockManager(4, 2)
    table = []
    bm.ensure(table, 6)
    fork = bm.share(table[:1])
    bm.truncate(table, 2)                    # blocks 1 and 2 go; block 0 stays
    assert sorted(bm.take_released()) == [1, 2] and bm.take_released() == []
    bm.free(table)
    assert bm.take_released() == []          # block 0: the fork still owns it
    bm.free(fork)
    assert bm.take_released() == [0]


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_leave_nothing_allocated(seed):
    rng = random.Random(seed)
    bm = BlockManager(rng.randrange(4, 40), rng.choice([1, 2, 4, 16]))
    live: list[list[int]] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.35 or not live:
            table = []
            if bm.ensure(table, rng.randrange(1, 60)):
                live.append(table)
            else:
                assert table == []
        elif op < 0.6:
            table = rng.choice(live)
            bm.ensure(table, len(table) * bm.block_size + rng.randrange(0, 9))   # lookahead growth
        elif op < 0.75:
            table = rng.choice(live)
            bm.truncate(table, rng.randrange(0, len(table) * bm.block_size + 1))  # rollback
        elif op < 0.85:
            live.append(bm.share(rng.choice(live)))
        else:
            bm.free(live.pop(rng.randrange(len(live))))      # finish / abort / preempt
        owned = sum(len(t) for t in live)
        assert sum(bm.ref_counts) == owned
        assert bm.num_free_blocks == sum(1 for c in bm.ref_counts if c == 0)
    for table in live:
        bm.free(table)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
