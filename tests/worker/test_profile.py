"""`dspark profile` on a tiny pair: a well-formed monotone table that matches its engine, and
profiling leaves the engine's results untouched."""

import pytest

from dspark import LLM, SamplingParams
from dspark.spec.planner import CostTable
from dspark.worker.profile import ProfileConfig, _verify_rows, monotone
from tiny import save_random_drafter, save_tiny


def test_monotone_cuts_a_spike_down_to_the_sizes_above_it():
    assert monotone([3.0, 2.0, 4.0, 1.0, 5.0]) == [1.0, 1.0, 1.0, 1.0, 5.0]
    assert monotone([80.0, 8.0, 9.0, 12.0]) == [8.0, 8.0, 9.0, 12.0]


def test_a_noisy_profile_still_prices_every_step_above_zero():
    """Past the sizes timed for 4 requests, a step is priced from what one request's steps add:
    under load the larger one-request step timed faster than the smaller, by more than the
    whole 4-request step. That made an entry negative, the table invalid and the engine fail to
    start; the addition is now never negative."""
    sizes, counts, gamma = [1, 2, 4, 8, 16], [1, 4], 1
    measured = {(1, 1): 5.0, (1, 2): 5.0, (1, 4): 20.0, (1, 8): 20.0, (1, 16): 9.0,
                (4, 4): 6.0, (4, 8): 7.0}
    rows = _verify_rows(measured, counts, sizes, 16, gamma)
    assert all(c > 0 for row in rows for c in row[1:])
    CostTable(fingerprint={}, verify_ms=rows, verify_requests=counts, draft_ms=[0.0, 1.0])
    assert rows[1][16] == 7.0 and rows[1][8] == 7.0     # 7 + max(0, 9 - 20), not 7 - 11


def test_profile_table_is_complete_monotone_and_fingerprinted(tmp_path):
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=1)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, seed=2)
    llm = LLM(str(tmp_path / "t"), dtype="float32", drafter=str(tmp_path / "d"), max_model_len=128,
              graph="eager")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = llm.generate([[3, 4, 5], [7, 8]], greedy)
    table = llm.engine.profile(ProfileConfig(max_tokens=9, max_requests=3, context_len=20,
                                             repeats=1, warmup=0))
    assert table.max_tokens == 9 and table.max_requests == 3 and table.verify_requests == [1, 2, 3]
    for fewer, row in zip(table.verify_ms, table.verify_ms[1:]):         # more requests never cheaper
        assert all(b >= a for a, b in zip(fewer[1:], row[1:]))
    for row in table.verify_ms:                                          # nor more tokens
        assert all(b >= a > 0 for a, b in zip(row[1:], row[2:]))
    assert all(b >= a > 0 for a, b in zip(table.draft_ms[1:], table.draft_ms[2:]))
    assert table.fingerprint == llm.engine.cost_fingerprint() and table.fingerprint["gamma"] == 3
    table.save(str(tmp_path / "cost.json"))
    CostTable.load(str(tmp_path / "cost.json")).check_fingerprint(llm.engine.cost_fingerprint())
    after = llm.generate([[3, 4, 5], [7, 8]], greedy)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    llm.engine.add_request([3, 4], greedy)
    with pytest.raises(RuntimeError, match="idle engine"):
        llm.engine.profile(ProfileConfig(max_tokens=2, max_requests=1, repeats=1, warmup=0))


def test_profile_times_the_bucket_staircase(tmp_path):
    """Every graph bucket is timed and the counts between two buckets cost what the upper one
    costs; past the largest bucket every `token_stride`-th count is timed."""
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=2, seed=1)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, layer_ids=(0,), seed=2)
    llm = LLM(str(tmp_path / "t"), dtype="float32", drafter=str(tmp_path / "d"), max_model_len=128,
              graph="eager", max_graph_tokens=16, max_num_batched_tokens=64)
    from dspark.worker.profile import _token_sizes
    cfg = ProfileConfig(max_tokens=40, max_requests=2, context_len=8, repeats=1, warmup=0, token_stride=12)
    assert _token_sizes(llm.engine.worker, cfg) == [1, 2, 4, 8, 16, 28, 40]
    table = llm.engine.profile(cfg)
    v = table.verify_ms[0]
    assert v[5] == v[6] == v[7] == v[8] and v[9] == v[16] and v[17] == v[28] and v[29] == v[40]
    assert llm.engine.cost_fingerprint()["buckets"] == [1, 2, 4, 8, 16]


def test_a_drafter_replaced_in_the_same_folder_does_not_match_its_old_table(tmp_path):
    import json
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=1)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, seed=2)
    kw = dict(dtype="float32", drafter=str(tmp_path / "d"), max_model_len=128, graph="eager")
    old = LLM(str(tmp_path / "t"), **kw).engine.cost_fingerprint()
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, seed=2, rank=4)
    new = LLM(str(tmp_path / "t"), **kw).engine.cost_fingerprint()
    assert old["drafter"] == new["drafter"] and old["drafter_config"] != new["drafter_config"]
    table = CostTable(fingerprint=old, verify_ms=[0.0, 1.0], draft_ms=[0.0, 1.0])
    with pytest.raises(ValueError, match="drafter_config"):
        table.check_fingerprint(new)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["markov_rank"] == 4


def test_draft_cost_includes_the_context_append(tmp_path, monkeypatch):
    """A drafting step also appends its requests' verify rows (γ+1 each) to the drafter's
    context, which a plain step does not: the draft cost carries it, once per timed call, with
    the rows of every request. Held rows are priced by the slope of two appends (1 and 8 rows
    at this context length), here 2 ms a row (medians of 3: a sleep can overshoot)."""
    import time
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=1)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, seed=2)
    llm = LLM(str(tmp_path / "t"), dtype="float32", drafter=str(tmp_path / "d"), max_model_len=128,
              graph="eager")
    appended = []
    runner = llm.engine.worker.runner

    def slow_append(kv, aux_hidden, positions, write_rows, write_slots):
        appended.append(aux_hidden.shape[0])
        time.sleep(0.03 + 0.002 * aux_hidden.shape[0])   # stands in for the append (no CPU noise)

    monkeypatch.setattr(runner, "append_context", slow_append)
    table = llm.engine.profile(ProfileConfig(max_tokens=4, max_requests=2, context_len=8,
                                             repeats=3, warmup=0))
    assert appended == [4, 8] * 3 + [1, 8] * 3          # none from the verify timings
    assert table.draft_ms[1] >= 30.0 and table.draft_ms[2] >= 30.0
    assert table.held_row_ms == pytest.approx(2.0, abs=1.0)


def test_a_burst_of_load_reaches_every_size_alike(monkeypatch):
    """Sizes are timed in rounds, once each per round: a burst of load as long as several calls
    (here 10x for five calls in a row) costs each size at most two of its five samples, so every
    median is the size's true cost; timed back to back, one size would take the whole burst."""
    import types
    import dspark.worker.profile as profile
    clock = types.SimpleNamespace(now=0.0, calls=0)

    def work(ms: float):
        def fn():
            clock.calls += 1
            clock.now += ms / 1e3 * (10.0 if 6 <= clock.calls < 11 else 1.0)
        return fn
    monkeypatch.setattr(profile, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    bar = types.SimpleNamespace(update=lambda n: None)
    cfg = ProfileConfig(repeats=5, warmup=1)
    assert profile._timed_in_rounds([work(1.0), work(2.0), work(3.0), work(4.0)], cfg, bar) == \
        pytest.approx([1.0, 2.0, 3.0, 4.0])


def test_step_rows_spread_drafts_over_the_requests_and_the_rest_is_a_joining_prefill():
    from dspark.worker.profile import request_counts, step_rows
    assert step_rows(4, 4, gamma=3, longest=10) == [1, 1, 1, 1]
    assert step_rows(4, 6, gamma=3, longest=10) == [2, 2, 1, 1]
    assert step_rows(2, 8, gamma=3, longest=10) == [4, 4]
    assert step_rows(2, 13, gamma=3, longest=10) == [4, 4, 5]
    assert step_rows(2, 31, gamma=3, longest=10) == [4, 4, 10, 10, 3]
    assert request_counts(1) == [1] and request_counts(12) == [1, 2, 4, 8, 12]
