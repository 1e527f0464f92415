"""Piecewise CUDA graphs (`--graph cuda`) on an NVIDIA GPU: every bucket's replay gives the live
rows what an unpadded eager step gives, dummy rows never touch the KV cache, and greedy decoding
is unchanged. The replay loop itself is also checked on the CPU (test_graphs.py, `pieces`)."""

import pytest
import torch

from dspark.models.loader import load_target
from dspark.runner.backends import CudaGraphPiece, PiecewiseRunner
from dspark.runner.draft_pieces import DraftPieces
from dspark.runner.graphs import StepGraphs, dummy_metadata
from dspark.worker.inputs import RequestChunk, build_inputs
from dspark.models.kv_cache import allocate_kv_cache
from tiny import save_random_drafter, save_tiny

pytestmark = pytest.mark.cuda

BLOCK, NUM_BLOCKS, BUCKETS, AUX = 4, 64, [1, 2, 4, 8, 16], (0, 1)
CLOSE = dict(atol=1e-4, rtol=1e-4)      # fp32; a padded GEMM may take another kernel than unpadded


@pytest.fixture(scope="module")
def device():
    if not torch.cuda.is_available():
        pytest.fail("the cuda tests need an NVIDIA GPU (deselect them with -m 'not cuda')")
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch.device("cuda")


@pytest.fixture(scope="module")
def target(tmp_path_factory, device):
    path = tmp_path_factory.mktemp("cuda_graph_target")
    save_tiny(str(path), "qwen3", tied=True, vocab=96, num_hidden_layers=2, head_dim=16, seed=5)
    return load_target(str(path), torch.float32, device="cuda", max_positions=256)


def new_cache(target, device, seed=0):
    caches = allocate_kv_cache(target.config, NUM_BLOCKS, BLOCK, torch.float32, device)
    g = torch.Generator(device=device).manual_seed(seed)
    for k, v in caches:
        k.normal_(generator=g)
        v.normal_(generator=g)
    return caches


def clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


@pytest.fixture(scope="module")
def graphs(target, device):
    g = StepGraphs(target.model, "cuda", BUCKETS, device, aux_layer_ids=AUX)
    g.capture(new_cache(target, device), BLOCK)
    return g


def step(q_lens, device, start=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    per = -(-(start + 16) // BLOCK)
    chunks = [RequestChunk(torch.randint(3, 90, (q,), generator=g).tolist(), start,
                           list(range(r * per, (r + 1) * per)), q) for r, q in enumerate(q_lens)]
    return build_inputs(chunks, BLOCK, device)


def unpadded(target, inputs, caches):
    return target.model.run_stack(inputs.input_ids, inputs.positions, inputs.attn, caches, AUX)


def test_every_bucket_is_captured_piecewise_in_one_pool(graphs, target):
    assert graphs.graph_pool is not None and graphs.stats.capture_fallbacks == 0
    for b in BUCKETS:
        runner = graphs.runners[b]
        assert isinstance(runner, PiecewiseRunner)
        assert len(runner.pieces) == len(target.model.layers) + 1
        assert all(isinstance(p, CudaGraphPiece) for p in runner.pieces)


@pytest.mark.parametrize("q_lens", [[1], [2], [1, 2], [4], [3, 1, 1], [8], [2, 3, 1, 1, 1], [5, 5, 5],
                                    [8, 8]])
def test_live_rows_and_kv_match_an_unpadded_eager_step(graphs, target, device, q_lens):
    inputs = step(q_lens, device)
    ref_cache, cache = new_cache(target, device), new_cache(target, device)
    before = clone(cache)
    with torch.inference_mode():
        ref_x, ref_aux = unpadded(target, inputs, ref_cache)
        x, aux = graphs.run(inputs.input_ids, inputs.positions, inputs.attn, cache)
    torch.testing.assert_close(x, ref_x, **CLOSE)
    torch.testing.assert_close(aux, ref_aux, **CLOSE)
    written = set(inputs.attn.write_slots.tolist())
    for (k, v), (rk, rv), (k0, _) in zip(cache, ref_cache, before):
        torch.testing.assert_close(k, rk, **CLOSE)
        torch.testing.assert_close(v, rv, **CLOSE)
        assert set((k != k0).flatten(1).any(1).nonzero().flatten().tolist()) <= written


def test_live_kv_is_bit_identical_with_and_without_dummies(graphs, target, device):
    """[2, 3] leaves 3 dummy rows in the 8-token bucket; [2, 3, 3] fills it. The first layer's
    K/V of the first two requests come from the same rows at the same shape: equal bit for bit."""
    padded, full = step([2, 3], device, seed=4), step([2, 3, 3], device, seed=4)
    assert torch.equal(full.input_ids[:5], padded.input_ids)
    a, b = new_cache(target, device), new_cache(target, device)
    with torch.inference_mode():
        xa, _ = graphs.run(padded.input_ids, padded.positions, padded.attn, a)
        xb, _ = graphs.run(full.input_ids, full.positions, full.attn, b)
    slots = padded.attn.write_slots
    assert torch.equal(a[0][0][slots], b[0][0][slots]) and torch.equal(a[0][1][slots], b[0][1][slots])
    torch.testing.assert_close(xa, xb[:5], **CLOSE)


def test_a_thousand_all_dummy_replays_leave_the_kv_cache_unchanged(graphs, target, device):
    cache = new_cache(target, device, seed=3)
    before = clone(cache)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    meta = dummy_metadata(BLOCK, device)
    with torch.inference_mode():
        for _ in range(1000):
            graphs.run(empty, empty, meta, cache)
    torch.cuda.synchronize()
    for (k, v), (k0, v0) in zip(cache, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    inputs = step([2, 1], device)
    with torch.inference_mode():
        ref_x, _ = unpadded(target, inputs, clone(before))
        x, _ = graphs.run(inputs.input_ids, inputs.positions, inputs.attn, cache)
    torch.testing.assert_close(x, ref_x, **CLOSE)


def test_returned_hidden_states_survive_the_next_replay(graphs, target, device):
    first, second = step([3], device, seed=1), step([2], device, seed=2)
    with torch.inference_mode():
        x1, aux1 = graphs.run(first.input_ids, first.positions, first.attn, new_cache(target, device))
        kept = x1.clone(), aux1.clone()
        graphs.run(second.input_ids, second.positions, second.attn, new_cache(target, device))
    assert torch.equal(x1, kept[0]) and torch.equal(aux1, kept[1])


VOCAB = 32


def test_greedy_output_with_cuda_graphs_equals_eager(tmp_path_factory, device):
    import random

    from dspark import LLM, SamplingParams
    target_dir = str(tmp_path_factory.mktemp("cuda_lossless_target"))
    save_tiny(target_dir, "qwen3", tied=True, vocab=VOCAB, num_hidden_layers=4, seed=11)
    drafter_dir = str(tmp_path_factory.mktemp("cuda_lossless_drafter"))
    save_random_drafter(drafter_dir, target_dir, gamma=4, copy_prev=9.0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB - 1) for _ in range(rng.randrange(2, 30))] for _ in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 40), ignore_eos=True)
              for _ in range(12)]
    common = dict(dtype="float32", device="cuda", block_size=4, max_model_len=256,
                  kv_cache_bytes=4096 * 2 * 5 * 2 * 16 * 4, max_graph_tokens=16, max_num_batched_tokens=64)
    for drafter in (None, drafter_dir):
        reference = LLM(target_dir, drafter=drafter, graph="eager", **common).generate(prompts, params)
        llm = LLM(target_dir, drafter=drafter, graph="cuda", **common)
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in reference]
        stats = llm.engine.worker.runner.stats()
        assert stats.capture_fallbacks == 0 and sum(stats.target_replays.values()) > 0
        if drafter is not None:
            draft = llm.engine.worker.runner.draft_graphs
            assert sum(stats.draft_replays.values()) > 0
            assert all(isinstance(r, DraftPieces) for r in draft.runners.values())


def test_draft_buckets_are_captured_and_match_an_unpadded_propose(tmp_path_factory, device):
    """Every request bucket of the draft step replays its captured pieces; the live rows get
    what an eager, unpadded `propose` gives, greedy and seeded, and no cache is written."""
    from dspark.models.drafter_loader import load_drafter
    from dspark.runner.draft_graphs import DraftGraphs
    from dspark.sampling_params import SamplingParams
    from dspark.spec.draft import propose
    from dspark.spec.sampler import SamplingTensors
    target_dir = str(tmp_path_factory.mktemp("cuda_draft_target"))
    save_tiny(target_dir, "qwen3", tied=True, vocab=96, num_hidden_layers=4, head_dim=16, seed=5)
    drafter_dir = str(tmp_path_factory.mktemp("cuda_draft_drafter"))
    save_random_drafter(drafter_dir, target_dir, gamma=4, markov_type="rnn", num_layers=2)
    target = load_target(target_dir, torch.float32, device="cuda", max_positions=256)
    drafter = load_drafter(drafter_dir, target.config, target.model.embed_tokens, target.model.lm_head,
                           torch.float32)
    kv = new_cache(drafter, device, seed=2)
    before = clone(kv)
    g = DraftGraphs(drafter, "cuda", [1, 2, 4, 8], device, BLOCK, 16)
    g.capture(kv)
    assert g.stats.capture_fallbacks == 0 and all(isinstance(r, DraftPieces) for r in g.runners.values())
    for r in (1, 3, 8):
        gen = torch.Generator().manual_seed(r)
        anchors = torch.randint(3, 90, (r,), generator=gen).to(device)
        starts = torch.randint(1, 24, (r,), generator=gen).to(device)                # + 5 slots: 8 pages
        tables = torch.stack([torch.arange(i * 8, i * 8 + 8) for i in range(r)]).to(device)
        for seeded in (False, True):
            def st():
                params = [SamplingParams(temperature=0.8, seed=i) if seeded else SamplingParams(temperature=0)
                          for i in range(r)]
                gens = [torch.Generator(device=device).manual_seed(i) if seeded else None for i in range(r)]
                return SamplingTensors.build(params, gens, 96, device)
            with torch.inference_mode():
                out = g.run(kv, anchors, starts, tables, st())
                ref = propose(drafter, kv, anchors, starts, tables, BLOCK, st())
            assert out.bucket == g.bucket_for(r) and torch.equal(out.proposal.tokens, ref.tokens)
            torch.testing.assert_close(out.proposal.confidence_logits, ref.confidence_logits, **CLOSE)
    for (k, v), (k0, v0) in zip(kv, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)
