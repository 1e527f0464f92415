"""Two CPU ranks over gloo: outputs equal one engine's, and both ranks run the same key every step."""

import functools

import pytest

from dspark import LLM
from dspark.distributed.group import start_group
from dspark.llm import build_config
from dp_helpers import engine_with_blocks
from tiny import greedy_workload, save_random_drafter, save_tiny

pytestmark = pytest.mark.slow          # every test starts a group of processes (seconds)

VOCAB = 32
PER_TOKEN = 2 * (4 + 1) * 2 * 16 * 4       # K+V of 4 target + 1 drafter layers, fp32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tmp_path_factory.mktemp("dp_target")
    save_tiny(str(target), "qwen3", tied=True, vocab=VOCAB, num_hidden_layers=4, seed=11)
    drafter = tmp_path_factory.mktemp("dp_drafter")
    save_random_drafter(str(drafter), str(target), gamma=4)
    return str(target), str(drafter)


def engine_kwargs(models, **kw):
    target, drafter = models
    kw.setdefault("spec_schedule", "verify-all")       # step shapes that depend on nothing else
    return dict(model=target, dtype="float32", drafter=drafter, block_size=4,
                kv_cache_bytes=4096 * PER_TOKEN, max_model_len=256, graph="eager", **kw)


def workload(n, seed=0, max_out=40):
    return greedy_workload(n, VOCAB, seed, max_out)


@pytest.fixture(scope="module")
def reference(models):
    prompts, params = workload(12)
    llm = LLM(**engine_kwargs(models))
    return [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


@pytest.fixture(scope="module")
def group(models):
    llm = LLM(**engine_kwargs(models, data_parallel_size=2, dp_timeout_s=20.0))
    llm.engine.key_log = []
    yield llm
    llm.close()
    assert all(p.exitcode == 0 for p in llm.engine.processes.values())


def assert_same_key_every_step(engine, since=0):
    replays = engine.key_log[since:]
    assert replays, "no step ran"
    for ran in replays:
        keys = {key for key, _ in ran}
        assert len(keys) == 1, f"ranks ran different keys: {ran}"
    return replays


def test_asymmetric_batches_equal_one_engine(group, reference):
    prompts, params = workload(12)
    since = len(group.engine.key_log)
    out = [o.token_ids for o in group.generate(prompts[:5], params[:5])]   # 3 on rank 0, 2 on rank 1
    assert out == reference[:5]
    replays = assert_same_key_every_step(group.engine, since)
    assert all(live for ran in replays[:1] for _, live in ran)             # both busy at first


def test_one_idle_rank_runs_dummies(group, reference):
    prompts, params = workload(12)
    since, dummies = len(group.engine.key_log), group.engine.local.worker.runner.dummy_steps
    out = group.generate([prompts[7]], params[7])[0].token_ids              # rank 1 has nothing
    assert out == reference[7]
    replays = assert_same_key_every_step(group.engine, since)
    assert all(ran[0][1] and not ran[1][1] for ran in replays)              # rank 0 live, rank 1 dummy
    assert any(ran[1][0].draft_reqs for ran in replays)     # rank 1's dummy query drafted too
    assert group.engine.local.worker.runner.dummy_steps == dummies


def test_shrinking_batches_step_down_together(group, reference):
    """Step by step: rank 0's padding rows past its live rows are dummies after every step."""
    prompts, params = workload(12)
    engine = group.engine
    since = len(engine.key_log)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    graphs, done, checked = engine.local.worker.runner.graphs, {}, 0
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if engine.last_rows is None or len(engine.key_log) == since:
            continue
        key, live = engine.key_log[-1][0]
        tokens = engine.last_rows[0].tokens if live else 0
        if key.tokens is not None:
            assert graphs.input_ids[key.tokens][tokens:].eq(0).all()
            assert graphs.positions[key.tokens][tokens:].eq(0).all()
            checked += 1
    assert [done[i] for i in ids] == reference
    replays = assert_same_key_every_step(engine, since)
    decode = [ran[0][0].tokens for ran in replays[-10:]]
    assert decode == sorted(decode, reverse=True) and decode[-1] < max(decode)   # buckets shrink
    assert checked >= len(replays) - 1


def test_different_page_counts(models, reference):
    prompts, params = workload(12)
    config = build_config(**engine_kwargs(models, data_parallel_size=2))
    factory = functools.partial(engine_with_blocks, {1: 1024 * PER_TOKEN})
    engine = start_group(config, factory)
    engine.key_log = []
    try:
        llm = LLM.__new__(LLM)
        llm.engine, llm.tokenizer = engine, None
        out = [o.token_ids for o in llm.generate(prompts, params)]
        assert out == reference
        assert_same_key_every_step(engine)
        rows = engine.load()
        assert rows.num_blocks == 4096 // 4 + 1024 // 4
    finally:
        engine.close()


@pytest.mark.slow
def test_compiled_buckets_equal_one_engine(models, reference):
    """Both ranks compile their buckets; capture presence is agreed and replays stay exact."""
    prompts, params = workload(12)
    llm = LLM(**{**engine_kwargs(models, data_parallel_size=2, max_graph_tokens=16, max_num_seqs=8),
                 "graph": "compile"})
    llm.engine.key_log = []
    try:
        out = [o.token_ids for o in llm.generate(prompts, params)]
        replays = assert_same_key_every_step(llm.engine)
        assert any(ran[0][0].captured for ran in replays)
    finally:
        llm.close()
    assert out == reference


def test_confidence_budgets_planned_per_rank(models, reference):
    """Each rank plans its own verify budget (cost table measured at start-up); the agreed token
    bucket holds every rank's trimmed step, and outputs stay exact."""
    prompts, params = workload(12)
    llm = LLM(**engine_kwargs(models, data_parallel_size=2, spec_schedule="confidence",
                              cost_table="auto", max_num_seqs=8))
    llm.engine.key_log = []
    try:
        out = [o.token_ids for o in llm.generate(prompts, params)]
        assert_same_key_every_step(llm.engine)
        stats = llm.engine.spec_stats
        assert stats.draft_rounds > 0 and stats.verified_tokens <= stats.drafted_tokens
    finally:
        llm.close()
    assert out == reference
