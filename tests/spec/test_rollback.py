"""Rollback: after speculative steps with rejections, the KV of committed positions is exactly
what a fresh prefill of the committed tokens writes, for the target and the drafter."""

import torch

from dspark import LLM, SamplingParams
from dspark.spec.planner import StepPlan
from tiny import save_random_drafter, save_tiny, speculating


def committed_kv(engine, seq, n):
    bs = engine.block_manager.block_size
    slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(n)])
    target = [torch.stack([k[slots], v[slots]]) for k, v in engine.worker.kv_caches]
    draft = [torch.stack([k[slots], v[slots]]) for k, v in engine.worker.draft_kv]
    return target, draft


def test_committed_kv_equals_fresh_prefill(tmp_path):
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=4)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=5, copy_prev=6.0, seed=1)

    def llm():
        return LLM(str(tmp_path / "t"), dtype="float32", drafter=str(tmp_path / "d"), block_size=4,
                   max_model_len=128, kv_cache_bytes=1 << 20, graph="eager")

    spec = speculating(llm()).engine        # a cost table measured here could decline to draft
    rid = spec.add_request([3, 9, 4, 7, 11], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    for _ in range(8):
        spec.step()
    stats = spec.spec_stats
    assert stats.accepted_tokens < stats.verified_tokens, "the run must include rejections"
    assert stats.accepted_tokens > 0
    seq = spec.requests[rid]
    n = seq.num_computed_tokens
    assert n == seq.num_tokens - 1                       # everything but the anchor is cached
    fresh = llm().engine
    fid = fresh.add_request((seq.prompt_token_ids + seq.output_token_ids)[:n], SamplingParams(temperature=0, max_tokens=1))
    fresh_seq = fresh.requests[fid]
    sched = fresh.scheduler.schedule()                   # one prefill step, inspected before commit
    fresh.worker.execute(fresh._worker_batch(sched))
    assert fresh.worker.deferred.num_rows == n           # a step that drafts nothing holds its rows
    fresh.worker.deferred.flush(fresh.worker._append)
    got_t, got_d = committed_kv(spec, seq, n)
    ref_t, ref_d = committed_kv(fresh, fresh_seq, n)
    for a, b in zip(got_t + got_d, ref_t + ref_d):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    # the block table holds nothing past the anchor's block
    assert len(seq.block_table) == spec.block_manager.blocks_needed(n + 1)


class DraftsOnly:
    """Stands in for the policy: the requests in `ids` draft (every draft verified), others not."""

    def __init__(self, ids):
        self.ids = ids

    def plan(self, candidates, step):
        return StepPlan([c.request_id in self.ids for c in candidates], 10 ** 6, 10 ** 6)

    def record(self, *args):
        pass

    def forget(self, request_id):
        pass

    def observe_step(self, *args):
        pass


def test_rows_held_past_another_requests_drafting_steps_reach_the_drafter_intact(tmp_path):
    """Two requests; only the first drafts for a while (each of its drafting steps appends its
    own held rows alone), then both do: each request's drafter K/V of committed positions is a
    fresh prefill's."""
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=4)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, copy_prev=6.0, seed=1)

    def llm():
        return LLM(str(tmp_path / "t"), dtype="float32", drafter=str(tmp_path / "d"), block_size=4,
                   max_model_len=128, kv_cache_bytes=1 << 20, graph="eager")

    engine = llm().engine
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    a = engine.add_request([3, 9, 4, 7, 11], params)
    b = engine.add_request([5, 6, 8, 2, 10, 12, 1], params)
    engine.policy = engine.scheduler.policy = DraftsOnly({a})
    for _ in range(6):
        engine.step()
    assert engine.worker.deferred.pending() > 0                # b's rows still held
    engine.policy.ids = {a, b}
    for _ in range(3):
        engine.step()
    assert engine.worker.deferred.pending() == 0
    for rid in (a, b):
        seq = engine.requests[rid]
        n = seq.num_computed_tokens
        fresh = llm().engine
        fid = fresh.add_request((seq.prompt_token_ids + seq.output_token_ids)[:n], SamplingParams(temperature=0, max_tokens=1))
        fresh.worker.execute(fresh._worker_batch(fresh.scheduler.schedule()))
        fresh.worker.deferred.flush(fresh.worker._append)
        _, got = committed_kv(engine, seq, n)
        _, ref = committed_kv(fresh, fresh.requests[fid], n)
        for x, y in zip(got, ref):
            assert torch.allclose(x, y, atol=1e-5), (rid, (x - y).abs().max())


def test_cli_generate_with_drafter_prints_stats(tmp_path, capsys):
    from dspark.cli import main
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=4)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, copy_prev=6.0)
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "t" / "tokenizer.json"))
    main(["generate", "--model", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"), "--dtype", "float32",
          "--graph", "eager", "--spec-schedule", "verify-all",     # drafts whatever this machine measures
          "--prompt", "w3 w9 w4", "--max-tokens", "12", "--ignore-eos", "--stats"])
    err = capsys.readouterr().err
    assert "[12 tokens" in err and "[all] rounds" in err and "per-position acceptance [" in err
