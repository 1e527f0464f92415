"""Context rows of steps that draft nothing, held and appended in one call before the drafter reads."""

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.models.drafter_loader import load_drafter
from dspark.models.loader import load_target
from dspark.spec.draft import append_context
from dspark.worker.deferred_context import DeferredContext, _last_writes
from dspark.models.kv_cache import allocate_kv_cache
from tiny import save_random_drafter, save_tiny


def _drafter(tmp_path):
    save_tiny(str(tmp_path / "t"), "llama", True)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=4, std=0.15, layer_ids=(-1, 0))
    target = load_target(str(tmp_path / "t"), torch.float32)
    return load_drafter(str(tmp_path / "d"), target.config, target.model.embed_tokens,
                        target.model.lm_head, torch.float32)


def _steps(drafter, g):
    """Three steps' append arguments; the last hands slot 5 (written by the first) to a new row."""
    width = len(drafter.config.target_layer_ids) * drafter.config.target_hidden_size
    specs = [([0, 1, 2], None, [4, 5, 6]), ([7, 8], [1], [9]), ([0, 3], None, [5, 12])]
    return [(torch.randn(len(pos), width, generator=g), torch.tensor(pos),
             None if rows is None else torch.tensor(rows), torch.tensor(slots)) for pos, rows, slots in specs]


class _Into:
    """The append a worker hands the deferred context: into the drafter's cache `kv`; counts its
    calls and the rows they write."""

    def __init__(self, drafter, kv):
        self.drafter, self.kv, self.calls, self.rows = drafter, kv, 0, 0

    def __call__(self, aux, positions, write_rows, write_slots):
        self.calls += 1
        self.rows += write_slots.shape[0]
        append_context(self.drafter, self.kv, aux, positions, write_rows, write_slots)


def _counted(worker) -> list[int]:
    """The rows each drafter-context append of `worker` writes, in call order, from now on."""
    rows, append = [], worker._append

    def counted(aux, positions, write_rows, write_slots):
        rows.append(write_slots.shape[0])
        append(aux, positions, write_rows, write_slots)
    worker._append = counted
    return rows


def _caches(drafter):
    return allocate_kv_cache(drafter.config, 4, 4, torch.float32, torch.device("cpu"))


def test_held_steps_append_what_step_by_step_appends_write(tmp_path):
    drafter = _drafter(tmp_path)
    steps = _steps(drafter, torch.Generator().manual_seed(0))
    reference, held = _caches(drafter), _caches(drafter)
    before = [(k.clone(), v.clone()) for k, v in held]
    deferred = DeferredContext(4, 4, torch.device("cpu"))
    with torch.inference_mode():
        for aux, pos, rows, slots in steps:
            append_context(drafter, reference, aux, pos, rows, slots)
            deferred.hold(aux, pos, rows, slots)
            aux.fill_(7.0)                                     # the caller's buffer is reused
        assert deferred.num_rows == 6                          # the rows that store K/V
        for (k, v), (k0, v0) in zip(held, before):             # nothing written while held
            assert torch.equal(k, k0) and torch.equal(v, v0)
        into = _Into(drafter, held)
        deferred.flush(into)
    assert into.rows == 5                                      # slot 5 written twice: once
    assert deferred.num_rows == 0 and into.calls == 1 and deferred.holds == 3
    for (k, v), (rk, rv) in zip(held, reference):
        assert torch.allclose(k, rk, atol=1e-6) and torch.allclose(v, rv, atol=1e-6)
        assert not torch.equal(k[5], torch.zeros_like(k[5]))


def test_a_drafting_step_appends_the_rows_of_its_requests_blocks_alone_and_the_rest_later(tmp_path):
    """Held rows in blocks 1, 2 and 3 (block size 4); the requests drafting own block 2: its row
    alone is appended, the others stay held in step order, and appending them later leaves the
    cache as step-by-step appends would."""
    drafter = _drafter(tmp_path)
    steps = _steps(drafter, torch.Generator().manual_seed(2))
    reference, held = _caches(drafter), _caches(drafter)
    deferred = DeferredContext(4, 4, torch.device("cpu"))
    with torch.inference_mode():
        for aux, pos, rows, slots in steps:
            append_context(drafter, reference, aux, pos, rows, slots)
            deferred.hold(aux, pos, rows, slots)
        into = _Into(drafter, held)
        deferred.flush(into, torch.tensor([2]))
        assert into.rows == 1
        assert deferred.pending() == 5 and deferred.num_rows == 6      # marked, not moved
        for (k, _), (rk, _) in zip(held, reference):
            assert torch.allclose(k[9], rk[9], atol=1e-6)
            assert not k[[4, 5, 6, 12]].any()                     # still held, not written
        deferred.flush(into, torch.tensor([0]))
        assert into.calls == 1                                 # nothing of block 0
        deferred.flush(into)
        assert into.rows == 1 + 4 and deferred.num_rows == 0
    for (k, v), (rk, rv) in zip(held, reference):
        assert torch.allclose(k, rk, atol=1e-6) and torch.allclose(v, rv, atol=1e-6)


def test_rows_of_a_block_released_after_them_are_dropped_and_a_reused_block_keeps_its_new_rows(tmp_path):
    drafter = _drafter(tmp_path)
    steps = _steps(drafter, torch.Generator().manual_seed(1))
    reference, held = _caches(drafter), _caches(drafter)
    deferred = DeferredContext(4, 4, torch.device("cpu"))
    with torch.inference_mode():
        # slots 4-6 (block 1) by the first step; then block 1 is released and handed on: the
        # third step writes slot 5 again, for its new owner
        for i, (aux, pos, rows, slots) in enumerate(steps):
            if i == 2:
                deferred.release([1])
            deferred.hold(aux, pos, rows, slots)
        deferred.release([3])                                  # slot 12: released after its row
        assert deferred.num_rows - deferred.pending() == 4     # dropped: 4, 5, 6 of the first step; 12
        into = _Into(drafter, held)
        deferred.flush(into)
        assert into.rows == 2                                  # slots 9 and 5 (the new owner's)
        aux, pos, rows, slots = steps[1]
        append_context(drafter, reference, aux, pos, rows, slots)
        aux, pos, rows, slots = steps[2]
        append_context(drafter, reference, aux[:1], pos[:1], None, slots[:1])
    for (k, v), (rk, rv) in zip(held, reference):
        assert torch.allclose(k, rk, atol=1e-6) and torch.allclose(v, rv, atol=1e-6)
        assert torch.equal(k[4], torch.zeros_like(k[4])) and torch.equal(k[12], torch.zeros_like(k[12]))


def test_a_full_hold_drops_released_rows_first_and_appends_only_when_live_rows_fill_half(tmp_path):
    drafter = _drafter(tmp_path)
    width = len(drafter.config.target_layer_ids) * drafter.config.target_hidden_size
    deferred = DeferredContext(4, 4, torch.device("cpu"), max_bytes=4 * width * 4)    # 4 fp32 rows
    held = _caches(drafter)
    g = torch.Generator().manual_seed(2)
    one = torch.randn(1, width, generator=g)
    with torch.inference_mode():
        deferred.hold(torch.randn(4, width, generator=g), torch.arange(4), None, torch.arange(4))
        assert not deferred.fits(one, None)
        with pytest.raises(ValueError, match="make room first"):
            deferred.hold(one, torch.arange(1), None, torch.arange(1))
        deferred.release([0])
        into = _Into(drafter, held)
        deferred.make_room(into)                               # all four released: dropped
        assert deferred.num_rows == 0 and into.calls == 0
        deferred.hold(torch.randn(3, width, generator=g), torch.arange(3), None, torch.arange(8, 11))
        deferred.make_room(into)                               # 3 live rows of 4: appended
        assert deferred.num_rows == 0 and into.calls == 1 and into.rows == 3
    k = held[0][0]
    assert not torch.equal(k[8], torch.zeros_like(k[8])) and torch.equal(k[0], torch.zeros_like(k[0]))


def test_the_buffer_grows_by_doubling_and_keeps_the_held_rows(tmp_path):
    drafter = _drafter(tmp_path)
    steps = _steps(drafter, torch.Generator().manual_seed(3))
    width = steps[0][0].shape[1]
    deferred = DeferredContext(64, 4, torch.device("cpu"))
    reference, held = _caches(drafter), _caches(drafter)
    with torch.inference_mode():
        for _ in range(100):                                   # 300 rows: past the first 256
            for aux, pos, rows, slots in steps[:1]:
                deferred.hold(aux, pos, rows, slots)
        big = torch.randn(5, width)
        deferred.hold(big, torch.arange(5), None, torch.arange(10, 15))
        assert deferred.aux.shape[0] == 512 and deferred.num_rows == 305
        deferred.flush(_Into(drafter, held))
        aux, pos, rows, slots = steps[0]
        append_context(drafter, reference, aux, pos, rows, slots)
        append_context(drafter, reference, big, torch.arange(5), None, torch.arange(10, 15))
    for (k, v), (rk, rv) in zip(held, reference):
        assert torch.allclose(k, rk, atol=1e-6) and torch.allclose(v, rv, atol=1e-6)


def test_the_last_write_of_a_slot_stands():
    assert sorted(_last_writes(torch.tensor([4, 5, 6, 9, 5, 12])).tolist()) == [0, 2, 3, 4, 5]
    assert _last_writes(torch.tensor([3, 3, 3])).tolist() == [2]
    assert _last_writes(torch.zeros(0, dtype=torch.long)).numel() == 0


def test_a_prefill_is_held_until_the_first_drafting_step(tmp_path):
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=4)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, copy_prev=6.0, seed=1)
    engine = LLM(str(tmp_path / "t"), dtype="float32", drafter=str(tmp_path / "d"), block_size=4,
                 max_model_len=64, kv_cache_bytes=1 << 20, graph="eager",
                 spec_schedule="verify-all").engine        # the first decode step drafts, whatever the load
    engine.add_request([3, 9, 4, 7, 11], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    snapshot = [k.clone() for k, _ in engine.worker.draft_kv]
    appends = _counted(engine.worker)
    engine.step()                                              # the prefill: no drafter pass
    deferred = engine.worker.deferred
    assert deferred.num_rows == 5 and appends == []
    assert all(torch.equal(k, k0) for (k, _), k0 in zip(engine.worker.draft_kv, snapshot))
    engine.step()                                              # drafts: the prefill rows go first
    assert deferred.num_rows == 0 and len(appends) == 2 and appends[0] == 5
    assert engine.spec_stats.draft_rounds == 1
    assert not all(torch.equal(k, k0) for (k, _), k0 in zip(engine.worker.draft_kv, snapshot))


def test_a_request_that_finishes_before_any_drafting_step_costs_no_append(tmp_path):
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=4)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, copy_prev=6.0, seed=1)
    engine = LLM(str(tmp_path / "t"), dtype="float32", drafter=str(tmp_path / "d"), block_size=4,
                 max_model_len=64, kv_cache_bytes=1 << 20, graph="eager",
                 spec_schedule="verify-all").engine        # the first decode step drafts, whatever the load
    appends = _counted(engine.worker)
    engine.add_request([3, 9, 4, 7, 11], SamplingParams(temperature=0, max_tokens=1))
    engine.step()                                              # prefill, one token, finished
    assert not engine.has_unfinished
    engine.add_request([5, 6, 8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()                                              # its prefill, held too
    deferred = engine.worker.deferred
    assert deferred.num_rows == 8 and appends == []
    engine.step()                                              # the first drafting step
    assert appends == [3, 1 + 3] and deferred.num_rows == 0   # its prompt, then its block: the
    assert engine.spec_stats.draft_rounds == 1                 # finished request's 5 rows never go
