"""Graph buckets: padded replays give the live rows exactly what an unpadded eager step gives,
and dummy rows never touch live state.

`pieces` runs the CUDA backend's piecewise replay loop on the CPU: each piece of the stack
behaves as a captured graph does for its caller (static outputs recomputed in place from the
tensors it was captured over), so everything but the CUDA capture itself is checked here.
"""

import pytest
import torch

from dspark.models.loader import load_target
from dspark.runner.backends import PiecewiseRunner, capture_pieces
from dspark.runner.graphs import DUMMY_POSITION, DUMMY_TOKEN_ID, StepGraphs, dummy_metadata, token_buckets
from dspark.worker.inputs import RequestChunk, build_inputs
from dspark.models.kv_cache import allocate_kv_cache
from tiny import save_random_drafter, save_tiny, speculating

BLOCK, NUM_BLOCKS, BUCKETS = 4, 64, [1, 4, 8, 16]
BACKENDS = ["eager", pytest.param("compile", marks=pytest.mark.slow)]   # compiling takes seconds
AUX = (0, 1)


class InPlacePiece:
    """A captured piece as its caller sees a CUDA graph: `out` stays the same tensors, and a
    replay recomputes them in place from whatever the piece was captured over."""

    def __init__(self, fn):
        self.fn, self.out = fn, fn()

    def __call__(self):
        new = self.fn()
        for name in ("x", "cos", "sin", "q", "k", "v"):
            if getattr(self.out, name) is not None:
                getattr(self.out, name).copy_(getattr(new, name))
        for i, t in self.out.aux.items():
            t.copy_(new.aux[i])
        return self.out


def piecewise_graphs(model, buckets, capture=InPlacePiece) -> StepGraphs:
    """StepGraphs whose buckets replay through the CUDA backend's loop with `capture`d pieces."""
    g = StepGraphs(model, "eager", buckets, torch.device("cpu"), aux_layer_ids=AUX)
    with torch.inference_mode():
        for b in buckets:
            g.runners[b] = capture_pieces(model, g.input_ids[b], g.positions[b], AUX, capture)
    return g


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("graph_target")
    save_tiny(str(path), "qwen3", tied=True, vocab=96, num_hidden_layers=2, head_dim=16, seed=5)
    return load_target(str(path), torch.float32, device="cpu", max_positions=256)


@pytest.fixture(scope="module", params=BACKENDS + ["pieces"])
def graphs(request, target):
    if request.param == "pieces":
        return piecewise_graphs(target.model, BUCKETS)
    g = StepGraphs(target.model, request.param, BUCKETS, torch.device("cpu"), aux_layer_ids=AUX)
    g.capture(allocate_kv_cache(target.config, NUM_BLOCKS, BLOCK, torch.float32, torch.device("cpu")), BLOCK)
    return g


def fresh_cache(target, seed=0):
    caches = allocate_kv_cache(target.config, NUM_BLOCKS, BLOCK, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return caches


def step(q_lens, start=6, seed=0):
    """Requests with `start` tokens cached each, adding q tokens: block tables 0.., disjoint."""
    g = torch.Generator().manual_seed(seed)
    per = -(-(start + 16) // BLOCK)
    chunks = [RequestChunk(torch.randint(3, 90, (q,), generator=g).tolist(), start,
                           list(range(r * per, (r + 1) * per)), q) for r, q in enumerate(q_lens)]
    return build_inputs(chunks, BLOCK, torch.device("cpu"))


def clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def unpadded(target, inputs, caches):
    return target.model.run_stack(inputs.input_ids, inputs.positions, inputs.attn, caches, AUX)


CLOSE = dict(atol=1e-5, rtol=1e-4)      # fp32: padding changes the GEMM's row count, not the math


@pytest.mark.parametrize("q_lens", [[1], [3], [1, 1, 1], [4, 4], [2, 3, 1, 1], [5, 5, 5], [8, 7]])
def test_live_rows_and_kv_match_an_unpadded_eager_step(target, graphs, q_lens):
    inputs = step(q_lens)
    ref_cache, cache = fresh_cache(target), fresh_cache(target)
    with torch.inference_mode():
        ref_x, ref_aux = unpadded(target, inputs, ref_cache)
        x, aux = graphs.run(inputs.input_ids, inputs.positions, inputs.attn, cache)
    assert graphs.bucket_for(sum(q_lens)) in BUCKETS
    assert x.shape == ref_x.shape and aux.shape == ref_aux.shape
    torch.testing.assert_close(x, ref_x, **CLOSE)
    torch.testing.assert_close(aux, ref_aux, **CLOSE)
    written = set(inputs.attn.write_slots.tolist())
    for (k, v), (rk, rv), (k0, v0) in zip(cache, ref_cache, fresh_cache(target)):
        torch.testing.assert_close(k, rk, **CLOSE)
        torch.testing.assert_close(v, rv, **CLOSE)
        changed = set((k != k0).flatten(1).any(1).nonzero().flatten().tolist())
        assert changed <= written                       # dummies wrote no slot


def test_kv_is_bit_identical_whether_the_rest_of_the_bucket_is_dummies_or_live(target, graphs):
    """Requests A and B fill 5 rows of the 16-token bucket; the other 11 rows are dummies in one
    step and two more live requests in the other. The K/V the step writes for A and B (first
    layer: projections of the same rows at the same GEMM shape) agree bit for bit; later layers
    see attention batched over 2 or 4 requests, which may round differently."""
    alone, full = step([2, 3], seed=4), step([2, 3, 8, 3], seed=4)
    assert torch.equal(full.input_ids[:5], alone.input_ids)
    a, b = fresh_cache(target), fresh_cache(target)
    with torch.inference_mode():
        xa, _ = graphs.run(alone.input_ids, alone.positions, alone.attn, a)
        xb, _ = graphs.run(full.input_ids, full.positions, full.attn, b)
    slots = alone.attn.write_slots
    torch.testing.assert_close(xa, xb[:5], **CLOSE)
    (ka, va), (kb, vb) = a[0], b[0]
    assert torch.equal(ka[slots], kb[slots]) and torch.equal(va[slots], vb[slots])
    for (ka, va), (kb, vb) in zip(a[1:], b[1:]):
        torch.testing.assert_close(ka[slots], kb[slots], **CLOSE)


def test_a_shrinking_batch_leaves_no_stale_row(target, graphs):
    big = step([8, 8], seed=1)
    cache = fresh_cache(target)
    with torch.inference_mode():
        graphs.run(big.input_ids, big.positions, big.attn, cache)
        ids, pos = graphs.input_ids[16], graphs.positions[16]
        assert ids[:16].tolist() == big.input_ids.tolist()
        small16 = step([2, 3, 3, 3], seed=2)           # 11 rows: also the 16-token bucket
        ref_x, _ = unpadded(target, small16, clone(cache))
        x, _ = graphs.run(small16.input_ids, small16.positions, small16.attn, cache)
    assert ids[11:].tolist() == [DUMMY_TOKEN_ID] * 5 and pos[11:].tolist() == [DUMMY_POSITION] * 5
    torch.testing.assert_close(x, ref_x, **CLOSE)


def test_a_thousand_all_dummy_replays_leave_live_state_unchanged(target, graphs):
    cache = fresh_cache(target, seed=3)
    before = clone(cache)
    empty = torch.zeros(0, dtype=torch.long)
    meta = dummy_metadata(BLOCK, torch.device("cpu"))
    with torch.inference_mode():
        for i in range(1000):
            x, _ = graphs.run(empty, empty, meta, cache)
            assert x.shape[0] == 0
    for (k, v), (k0, v0) in zip(cache, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    inputs = step([2, 1])
    with torch.inference_mode():
        ref_x, _ = unpadded(target, inputs, clone(before))
        x, _ = graphs.run(inputs.input_ids, inputs.positions, inputs.attn, cache)
    torch.testing.assert_close(x, ref_x, **CLOSE)


def test_steps_above_the_largest_bucket_run_unpadded_and_are_counted(target, graphs):
    inputs = step([9, 9])
    cache = fresh_cache(target)
    eager_before = graphs.stats.eager_steps
    with torch.inference_mode():
        ref_x, _ = unpadded(target, inputs, clone(cache))
        x, _ = graphs.run(inputs.input_ids, inputs.positions, inputs.attn, cache)
    assert torch.equal(x, ref_x)
    assert graphs.stats.eager_steps == eager_before + 1


def split(t: int) -> list[int]:
    """t tokens as a mix of decode rows and short verify chunks."""
    q_lens = []
    while t:
        q_lens.append(min(t, 1 + len(q_lens) % 4))
        t -= q_lens[-1]
    return q_lens


def test_piecewise_replay_matches_unpadded_eager_at_every_size_up_to_16(target):
    g = piecewise_graphs(target.model, token_buckets(16))
    assert g.buckets == [1, 2, 4, 8, 16]
    for t in range(1, 17):
        inputs = step(split(t), seed=t)
        ref_cache, cache = fresh_cache(target, seed=t), fresh_cache(target, seed=t)
        with torch.inference_mode():
            ref_x, ref_aux = unpadded(target, inputs, ref_cache)
            x, aux = g.run(inputs.input_ids, inputs.positions, inputs.attn, cache)
        torch.testing.assert_close(x, ref_x, **CLOSE)
        torch.testing.assert_close(aux, ref_aux, **CLOSE)
        for (k, v), (rk, rv) in zip(cache, ref_cache):
            torch.testing.assert_close(k, rk, **CLOSE)
            torch.testing.assert_close(v, rv, **CLOSE)
    assert sorted(g.stats.replays) == [1, 2, 4, 8, 16] and g.stats.eager_steps == 0


class StalePiece(InPlacePiece):
    """A piece whose replay does nothing: its outputs stay those of the all-dummy capture."""

    def __call__(self):
        return self.out


def test_the_piecewise_check_catches_a_replay_that_does_not_recompute(target):
    g = piecewise_graphs(target.model, [4], capture=StalePiece)
    inputs = step([3])
    with torch.inference_mode():
        ref_x, _ = unpadded(target, inputs, fresh_cache(target))
        x, _ = g.run(inputs.input_ids, inputs.positions, inputs.attn, fresh_cache(target))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(x, ref_x, **CLOSE)


def test_a_captured_bucket_refuses_other_input_buffers(target):
    g = piecewise_graphs(target.model, [4])
    runner = g.runners[4]
    assert isinstance(runner, PiecewiseRunner) and len(runner.pieces) == len(target.model.layers) + 1
    inputs = step([2, 2])
    with pytest.raises(ValueError, match="its own input buffers"), torch.inference_mode():
        runner(inputs.input_ids, inputs.positions, inputs.attn, fresh_cache(target))


def test_bucket_staircase_and_bad_configuration():
    assert token_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert token_buckets(512)[10:] == [64, 80, 96, 112, 128, 160, 192, 224, 256, 512]
    assert token_buckets(2048)[-3:] == [512, 1024, 2048] and token_buckets(100)[-3:] == [80, 96, 100]
    assert token_buckets(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        StepGraphs(torch.nn.Linear(1, 1), "cuda", [1], torch.device("cpu"))
    with pytest.raises(ValueError, match="increasing positive"):
        StepGraphs(torch.nn.Linear(1, 1), "eager", [4, 2], torch.device("cpu"))


# ---- through the engine ----------------------------------------------------------------------

VOCAB = 32


def make_llm(target_dir, drafter_dir=None, **kw):
    from dspark import LLM
    return speculating(LLM(target_dir, dtype="float32", drafter=drafter_dir, block_size=4, max_model_len=256,
                           kv_cache_bytes=4096 * 2 * 5 * 2 * 16 * 4, **kw))


def workload(n, seed=0):
    import random
    from dspark import SamplingParams
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB - 1) for _ in range(rng.randrange(2, 30))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 40), ignore_eos=True)
              for _ in range(n)]
    return prompts, params

@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_lossless_under_each_cpu_backend(tmp_path_factory, backend):
    """Plain decoding unpadded-eager vs DSpark at graph buckets: the same tokens (fp32)."""
    target_dir = str(tmp_path_factory.mktemp("lossless_target"))
    save_tiny(target_dir, "qwen3", tied=True, vocab=VOCAB, num_hidden_layers=4, seed=11)
    d = str(tmp_path_factory.mktemp("lossless_drafter"))
    save_random_drafter(d, target_dir, gamma=4, copy_prev=9.0)
    prompts, params = workload(12)
    reference = [o.token_ids for o in make_llm(target_dir, graph="eager", max_graph_tokens=1)
                 .generate(prompts, params)]
    llm = make_llm(target_dir, d, graph=backend, max_graph_tokens=16, max_num_batched_tokens=64)
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    stats = llm.engine.worker.runner.graphs.stats
    assert stats.capture_fallbacks == 0 and sum(stats.replays.values()) > 0
    assert set(stats.replays) <= set(llm.engine.worker.runner.graphs.buckets)
    assert llm.engine.spec_stats.accepted_tokens > 0


def test_a_failed_capture_is_a_startup_error_or_a_counted_fallback(tmp_path_factory, monkeypatch, caplog):
    import dspark.runner.backends as backends
    target_dir = str(tmp_path_factory.mktemp("fallback_target"))
    save_tiny(target_dir, "llama", tied=True, vocab=VOCAB, num_hidden_layers=2, seed=3)
    prompts, params = workload(4)
    ref = make_llm(target_dir, graph="eager").generate(prompts, params)

    def broken(graphs, bucket, kv_caches, meta):
        if bucket == 8:
            raise RuntimeError("no kernel for this shape")
        return None
    monkeypatch.setattr(backends, "build_runner", broken)
    with pytest.raises(RuntimeError, match="graph capture \\(compile\\) failed for the 8-token bucket"):
        make_llm(target_dir, graph="compile", max_graph_tokens=16)
    llm = make_llm(target_dir, graph="compile", max_graph_tokens=16, graph_fallback=True)
    assert llm.engine.worker.runner.graphs.stats.capture_fallbacks == 1
    assert "running it eagerly" in caplog.text
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in ref]


@pytest.mark.slow
def test_a_changed_thread_count_is_refused_before_any_request_fails(tmp_path):
    """Compiled graphs are specialised to the thread count they were captured at: a later
    torch.set_num_threads is refused with a message naming it, before the step is scheduled, and
    the same requests decode as before once the count is set back. Eager graphs do not care."""
    target_dir = str(tmp_path / "t")
    save_tiny(target_dir, "llama", tied=True, vocab=VOCAB, num_hidden_layers=2, seed=3)
    prompts, params = workload(2)
    threads = torch.get_num_threads()
    llm = make_llm(target_dir, graph="compile", max_graph_tokens=8, num_threads=1)
    try:
        ref = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match=r"thread count changed from 1 to 2 .* num_threads=2"):
            llm.generate(prompts, params, use_tqdm=False)
        assert not llm.engine.has_unfinished       # raised before scheduling: no request was failed
        torch.set_num_threads(1)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
        eager = make_llm(target_dir, graph="eager", num_threads=1)
        torch.set_num_threads(2)
        assert [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)] == ref
    finally:
        torch.set_num_threads(threads)
