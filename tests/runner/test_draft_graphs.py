"""Draft-step graph buckets: a padded replay gives the live requests exactly what an unpadded
`propose` gives, dummy requests stay dummies, and nothing they do reaches live state.

`pieces` runs the CUDA backend's piecewise replay (runner/draft_pieces.py) on the CPU: each piece
behaves for its caller as a captured graph does (static outputs recomputed in place from the
tensors it was captured over), so everything but the CUDA capture itself is checked here.
"""

import pytest
import torch
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch._dynamo.utils import counters

from dspark.models.drafter_loader import load_drafter
from dspark.models.loader import load_target
from dspark.sampling_params import SamplingParams
from dspark.spec.draft import propose
from dspark.spec.sampler import NoiseKey, SamplingTensors
from dspark.runner.draft_pieces import DraftPieces
from dspark.runner.draft_graphs import (DUMMY_BLOCK_ID, DUMMY_REQUEST_PREFIX, DUMMY_START,
                                        NEUTRAL_CONFIDENCE_LOGIT, DraftGraphs, is_reserved_request_id)
from dspark.runner.graphs import DUMMY_TOKEN_ID
from dspark.models.kv_cache import allocate_kv_cache
from tiny import save_random_drafter, save_tiny

CPU = torch.device("cpu")
BLOCK, NUM_BLOCKS, MAX_PAGES, BUCKETS = 4, 160, 16, [1, 2, 4, 8]
VOCAB = 96
BACKENDS = ["eager", pytest.param("compile", marks=pytest.mark.slow)]   # compiling takes seconds
DRAFTERS = {"rnn_dflash": dict(markov_type="rnn", sample_from_anchor=False, num_layers=2),
            "gated_anchor": dict(markov_type="gated", sample_from_anchor=True)}
CLOSE = dict(atol=1e-5, rtol=1e-4)      # fp32: padding changes the GEMM's row count, not the math


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("draft_graph_target"))
    save_tiny(path, "qwen3", tied=True, vocab=VOCAB, num_hidden_layers=4, head_dim=16, seed=5)
    return path


@pytest.fixture(scope="module", params=list(DRAFTERS))
def drafter(request, tmp_path_factory, target_dir):
    path = str(tmp_path_factory.mktemp("draft_graph_drafter"))
    save_random_drafter(path, target_dir, gamma=4, **DRAFTERS[request.param])
    target = load_target(target_dir, torch.float32, device="cpu", max_positions=256)
    return load_drafter(path, target.config, target.model.embed_tokens, target.model.lm_head,
                        torch.float32)


class InPlacePiece:
    """A captured piece as its caller sees a CUDA graph: `out` stays the same tensors, and a
    replay recomputes them in place from whatever the piece was captured over."""

    def __init__(self, fn):
        self.fn, self.out = fn, fn()

    def __call__(self):
        for old, new in zip(self.out, self.fn()):
            if old is not None:
                old.copy_(new)
        return self.out


class StalePiece(InPlacePiece):
    """A piece whose replay does nothing: its outputs stay those of the capture."""

    def __call__(self):
        return self.out


def piecewise_graphs(drafter, capture=InPlacePiece) -> DraftGraphs:
    """DraftGraphs whose buckets replay through the CUDA backend's loop with `capture`d pieces."""
    g = DraftGraphs(drafter, "eager", BUCKETS, CPU, BLOCK, MAX_PAGES)
    with torch.inference_mode():
        g.runners = {b: DraftPieces(drafter, b, capture) for b in BUCKETS}
    return g


@pytest.fixture(scope="module", params=BACKENDS + ["pieces"])
def graphs(request, drafter):
    if request.param == "pieces":
        return piecewise_graphs(drafter)
    g = DraftGraphs(drafter, request.param, BUCKETS, CPU, BLOCK, MAX_PAGES)
    g.capture(fresh_kv(drafter))
    return g


def fresh_kv(drafter, seed=0):
    kv = allocate_kv_cache(drafter.config, NUM_BLOCKS, BLOCK, torch.float32, CPU)
    g = torch.Generator().manual_seed(seed)
    for k, v in kv:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return kv


def clone(kv):
    return [(k.clone(), v.clone()) for k, v in kv]


def batch(r, seed=0, max_start=40, sampled=False):
    """r live requests with disjoint block tables of ragged widths (anchors, starts, tables, st)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(1, max_start, (r,), generator=g)
    pages = [-(-(int(s) + 5) // BLOCK) for s in starts]
    width = max(pages, default=1)
    tables = torch.zeros(r, width, dtype=torch.long)
    for i, n in enumerate(pages):
        tables[i, :n] = torch.arange(i * MAX_PAGES, i * MAX_PAGES + n)
    params = [SamplingParams(temperature=0.0) if not sampled or i % 3 == 1 else
              SamplingParams(temperature=0.7 + 0.1 * i, seed=None if i % 3 == 2 else 100 + i) for i in range(r)]
    st = sampling(params, seed)
    return torch.randint(3, VOCAB - 2, (r,), generator=g), starts, tables, st


def sampling(params, seed):
    keys = [None if p.seed is None or p.greedy else NoiseKey(p.seed * 7 + seed, 20) for p in params]
    return SamplingTensors.build(params, keys, VOCAB, CPU)


def run_both(graphs, drafter, kv, r, seed=0, sampled=False):
    """(padded replay, unpadded propose) of the same requests (a seeded row's noise is its key's)."""
    anchors, starts, tables, st = batch(r, seed, sampled=sampled)
    with torch.inference_mode():
        torch.manual_seed(seed)                         # unseeded rows: the same global noise
        out = graphs.run(kv, anchors, starts, tables, st)
        _, _, _, st = batch(r, seed, sampled=sampled)
        torch.manual_seed(seed)
        ref = propose(drafter, kv, anchors, starts, tables, BLOCK, st)
    return out, ref


@pytest.mark.parametrize("r", [1, 2, 3, 4, 5, 7, 8])
def test_live_rows_match_an_unpadded_propose_in_every_bucket(graphs, drafter, r):
    kv = fresh_kv(drafter)
    out, ref = run_both(graphs, drafter, kv, r, seed=r)
    assert out.bucket == graphs.bucket_for(r) and out.bucket in BUCKETS
    assert out.padded.tokens.shape[0] == out.bucket and out.proposal.tokens.shape[0] == r
    assert torch.equal(out.proposal.tokens, ref.tokens)
    assert out.proposal.probs is None and ref.probs is None
    torch.testing.assert_close(out.proposal.confidence_logits, ref.confidence_logits, **CLOSE)
    assert (out.padded.confidence_logits[r:] == NEUTRAL_CONFIDENCE_LOGIT).all()


@pytest.mark.parametrize("r", [1, 3, 8])
def test_sampled_rows_match_too(graphs, drafter, r):
    """Seeded rows draw their noise from their keys, unseeded ones from the global generator: the
    same draws, and the same q where an unseeded row needs one (1 request: seeded alone, raced)."""
    kv = fresh_kv(drafter)
    out, ref = run_both(graphs, drafter, kv, r, seed=10 + r, sampled=True)
    assert (out.proposal.probs is None) == (ref.probs is None) == (r < 3)
    if ref.probs is not None:
        torch.testing.assert_close(out.proposal.probs, ref.probs, **CLOSE)
    assert torch.equal(out.proposal.tokens, ref.tokens)
    torch.testing.assert_close(out.proposal.confidence_logits, ref.confidence_logits, **CLOSE)


def test_a_shrinking_batch_leaves_only_dummies_past_the_live_rows(graphs, drafter):
    kv = fresh_kv(drafter)
    buf = graphs.buffers[8]
    big = batch(8, seed=1, max_start=60, sampled=True)
    with torch.inference_mode():
        graphs.run(kv, *big)
    assert buf.anchors.tolist() == big[0].tolist() and buf.starts.tolist() == big[1].tolist()
    assert not buf.greedy.all()
    out, ref = run_both(graphs, drafter, kv, 5, seed=2)            # 5 rows: also the 8 bucket
    assert out.bucket == 8
    assert buf.anchors[5:].tolist() == [DUMMY_TOKEN_ID] * 3
    assert buf.starts[5:].tolist() == [DUMMY_START] * 3
    assert (buf.block_tables[5:] == DUMMY_BLOCK_ID).all()
    width = batch(5, seed=2)[2].shape[1]
    assert (buf.block_tables[:5, width:] == DUMMY_BLOCK_ID).all()  # no page of a wider old table
    assert buf.temperature[5:].tolist() == [1.0] * 3 and buf.greedy.all()
    assert torch.equal(out.proposal.tokens, ref.tokens)
    torch.testing.assert_close(out.proposal.confidence_logits, ref.confidence_logits, **CLOSE)


def test_dummy_ids_are_reserved_and_never_collide_with_live_ids(graphs, drafter):
    kv = fresh_kv(drafter)
    live = ["0", "1", "cmpl-0-0", DUMMY_REQUEST_PREFIX[:-1]]         # the last only looks close
    anchors, starts, tables, st = batch(4, seed=3)
    with torch.inference_mode():
        out = graphs.run(kv, anchors[:3], starts[:3], tables[:3], st.select([0, 1, 2]), live[:3])
        assert out.bucket == 4 and out.row_ids[:3] == live[:3]
        dummies = out.row_ids[3:]
        assert len(dummies) == 1 and all(is_reserved_request_id(i) for i in dummies)
        assert not set(dummies) & set(live) and not any(is_reserved_request_id(i) for i in live)
        out = graphs.run(kv, anchors, starts, tables, st, live)
        assert out.row_ids == live                                    # a full bucket: no dummy
        with pytest.raises(ValueError, match="reserved for dummy requests"):
            graphs.run(kv, anchors[:1], starts[:1], tables[:1], st.select([0]), [DUMMY_REQUEST_PREFIX + "7"])


def test_the_engine_refuses_a_request_id_in_the_reserved_namespace(target_dir):
    from dspark import LLM
    engine = LLM(target_dir, dtype="float32", block_size=4, max_model_len=64,
                 kv_cache_bytes=1 << 20, graph="eager").engine
    with pytest.raises(ValueError, match="reserved for the engine's padding"):
        engine.add_request([3, 4, 5], request_id=DUMMY_REQUEST_PREFIX + "0")
    assert engine.add_request([3, 4, 5], request_id="dummy-0") == "dummy-0"
    assert not is_reserved_request_id(engine.add_request([3, 4, 5]))


def test_a_thousand_all_dummy_replays_leave_both_caches_bit_identical(target_dir, tmp_path):
    """Through a running engine: live K/V in both caches, then all-dummy draft steps at every
    bucket (what an idle data-parallel rank runs), then the same requests carry on exactly."""
    from dspark import LLM
    d = str(tmp_path / "d")
    save_random_drafter(d, target_dir, gamma=3, copy_prev=9.0)
    prompts = [[3 + (7 * i + j) % 80 for j in range(5 + 3 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def make():
        return LLM(target_dir, dtype="float32", drafter=d, block_size=4, max_model_len=128,
                   kv_cache_bytes=1 << 21, max_num_batched_tokens=32, graph="eager")
    reference = [o.token_ids for o in make().generate(prompts, params)]
    engine = make().engine
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    worker, dg = engine.worker, engine.worker.runner.draft_graphs
    target_kv, draft_kv = clone(worker.kv_caches), clone(worker.draft_kv)
    empty = torch.zeros(0, dtype=torch.long)
    for i in range(1000):
        b = dg.buckets[i % len(dg.buckets)]
        out = dg.run(worker.draft_kv, empty, empty, empty.view(0, 1), bucket=b, table_width=1 + i % 5)
        assert out.proposal.tokens.shape == (0, 3) and len(out.row_ids) == b
    for (k, v), (k0, v0) in zip(worker.kv_caches + worker.draft_kv, target_kv + draft_kv):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert all(int(dg.buffers[b].starts.max()) == DUMMY_START for b in dg.buckets)
    done = {}
    while engine.has_unfinished:
        done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert [done[i] for i in ids] == reference


def test_steps_past_the_buckets_run_unpadded_and_are_counted(graphs, drafter):
    kv = fresh_kv(drafter)
    before = graphs.stats.eager_steps
    out, ref = run_both(graphs, drafter, kv, 9, seed=4)                 # more than 8 requests
    assert out.bucket is None and torch.equal(out.proposal.tokens, ref.tokens)
    anchors, starts, tables, st = batch(2, seed=5)
    wide = torch.cat([tables, torch.zeros(2, MAX_PAGES, dtype=torch.long)], dim=1)
    with torch.inference_mode():
        out = graphs.run(kv, anchors, starts, wide, st)                 # a table past the buffers
    assert out.bucket is None
    assert graphs.stats.eager_steps == before + 2


def test_a_forced_bucket_and_table_width_give_the_same_drafts(graphs, drafter):
    kv = fresh_kv(drafter)
    anchors, starts, tables, st = batch(3, seed=6)
    with torch.inference_mode():
        ref = propose(drafter, kv, anchors, starts, tables, BLOCK, st)
        for width in (MAX_PAGES, 4 * MAX_PAGES):        # a width past the buffers pads to them
            out = graphs.run(kv, anchors, starts, tables, st, bucket=8, table_width=width)
            assert out.bucket == 8 and torch.equal(out.proposal.tokens, ref.tokens)
            torch.testing.assert_close(out.proposal.confidence_logits, ref.confidence_logits, **CLOSE)
        with pytest.raises(ValueError, match="cannot run at bucket 2"):
            graphs.run(kv, anchors, starts, tables, st, bucket=2)
        with pytest.raises(ValueError, match="table width of 1"):
            graphs.run(kv, anchors, starts, tables, st, table_width=1)


@pytest.mark.slow
def test_compiled_replays_never_recompile(drafter):
    """One graph per request bucket at capture, none at replay: every bucket, live counts,
    context lengths (the dynamic dimension) and sampling modes reuse the captured graphs, and a
    recompile past them is an error, never a silent stall."""
    kv = fresh_kv(drafter)
    before = counters["stats"]["unique_graphs"]
    g = DraftGraphs(drafter, "compile", BUCKETS, CPU, BLOCK, MAX_PAGES)
    g.capture(kv)
    assert counters["stats"]["unique_graphs"] - before == len(BUCKETS)
    captured = counters["stats"]["unique_graphs"]
    for r in range(0, 9):
        for max_start in (3, 20, 60):
            anchors, starts, tables, st = batch(r, seed=r, max_start=max_start, sampled=r % 2 == 1)
            with torch.inference_mode():
                g.run(kv, anchors, starts, tables, st, table_width=None if r % 3 else MAX_PAGES)
    assert counters["stats"]["unique_graphs"] == captured
    assert g.stats.capture_fallbacks == 0 and g.stats.eager_steps == 0
    anchors, starts, tables, _ = batch(3, seed=1)                    # a shape no bucket has
    with torch.inference_mode(), pytest.raises(FailOnRecompileLimitHit):
        propose(drafter, kv, anchors, starts, tables, BLOCK, None, kv_len=8, run_block=g.runners[4])


def test_the_piecewise_check_catches_a_replay_that_does_not_recompute(drafter):
    kv = fresh_kv(drafter)
    out, ref = run_both(piecewise_graphs(drafter, capture=StalePiece), drafter, kv, 3, seed=3)
    assert not torch.equal(out.proposal.tokens, ref.tokens)


def test_a_captured_draft_bucket_refuses_another_shape(drafter):
    pieces = piecewise_graphs(drafter).runners[4]
    assert len(pieces.pieces) == drafter.config.num_layers + 1
    ids = torch.zeros(2, drafter.config.num_block_slots, dtype=torch.long)
    with pytest.raises(ValueError, match="captured at \\(4, "), torch.inference_mode():
        pieces(drafter, ids, ids, [], [], torch.ones(2, 4, dtype=torch.bool), ids[:, 0])


def test_a_failed_capture_is_an_error_or_a_counted_fallback(drafter, monkeypatch, caplog):
    kv = fresh_kv(drafter)

    def broken(self, bucket, kv):
        if bucket == 4:
            raise RuntimeError("no kernel for this shape")
        return None
    monkeypatch.setattr(DraftGraphs, "_build", broken)
    with pytest.raises(RuntimeError, match="draft graph capture \\(compile\\) failed for the 4-request"):
        DraftGraphs(drafter, "compile", BUCKETS, CPU, BLOCK, MAX_PAGES).capture(kv)
    g = DraftGraphs(drafter, "compile", BUCKETS, CPU, BLOCK, MAX_PAGES, fallback_to_eager=True)
    g.capture(kv)
    assert g.stats.capture_fallbacks == 1 and "running it eagerly" in caplog.text
    out, ref = run_both(g, drafter, kv, 3)
    assert torch.equal(out.proposal.tokens, ref.tokens)


def test_bad_configuration():
    with pytest.raises(ValueError, match="graph mode"):
        DraftGraphs(None, "auto", BUCKETS, CPU, BLOCK, MAX_PAGES)
    with pytest.raises(ValueError, match="increasing positive"):
        DraftGraphs(None, "eager", [4, 2], CPU, BLOCK, MAX_PAGES)
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        DraftGraphs(None, "cuda", BUCKETS, CPU, BLOCK, MAX_PAGES)
