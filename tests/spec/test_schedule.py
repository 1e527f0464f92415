"""Confidence-scheduled verification stays lossless whatever the budget, and its configuration
fails loudly."""

import math
from collections import Counter

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.spec.planner import CostTable, StepPlan
from test_lossless import VOCAB, drafter, make_llm, reference, target_dir, workload  # noqa: F401
from tiny import run_staggered, save_random_drafter, save_tiny


class ForcedBudget:
    """Stands in for the planner: every speculative step verifies `budget` drafts in total; with
    `skip_every`, every such request (counted over the run) is left out of the drafter pass."""

    def __init__(self, budget: int, skip_every: int = 0):
        self.budget_value, self.skip_every, self.steps, self.seen = budget, skip_every, [], 0

    def plan(self, candidates, step):
        drafted = []
        for _ in candidates:
            self.seen += 1
            drafted.append(not (self.skip_every and self.seen % self.skip_every == 0))
        caps = sum(c.verify_cap for c, d in zip(candidates, drafted) if d)
        if caps:
            self.steps.append(min(self.budget_value, caps))
        return StepPlan(drafted=drafted, budget=self.budget_value, full=len(candidates) * 1000)

    def record(self, request_id, z, verified, accepted):
        pass

    def observe_step(self, plan, requests, tokens, seconds):
        assert tokens >= requests >= len(plan.drafted) and seconds > 0

    def forget(self, request_id):
        pass


def forced(llm, budget: int, skip_every: int = 0) -> ForcedBudget:
    llm.engine.policy = llm.engine.scheduler.policy = ForcedBudget(budget, skip_every)
    return llm.engine.policy


def counting_drafter_passes(llm) -> list[int]:
    """Wrap the worker's drafter pass: the returned list grows by one per pass."""
    calls, draft = [], llm.engine.worker._draft

    def counted(*args, **kwargs):
        calls.append(1)
        return draft(*args, **kwargs)

    llm.engine.worker._draft = counted
    return calls


@pytest.mark.parametrize("budget", [0, 1, 2, 5, 11, 1000])
def test_greedy_lossless_under_any_budget(tmp_path_factory, target_dir, reference, budget):
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    prompts, params = workload(16)
    llm = make_llm(target_dir, d, max_num_batched_tokens=64)
    plan = forced(llm, budget)
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    stats = llm.engine.spec_stats
    assert stats.verified_tokens == sum(plan.steps)            # trimmed drafts: not verified
    assert stats.accepted_tokens <= stats.verified_tokens <= stats.drafted_tokens
    assert stats.drafted_tokens == stats.draft_rounds * 4      # full blocks: only verification trims
    if budget == 0:
        assert stats.accepted_tokens == 0
    if budget == 1000:          # never binding: exactly what verify-all verifies
        full = make_llm(target_dir, d, max_num_batched_tokens=64, spec_schedule="verify-all")
        full.generate(prompts, params)
        assert stats.verified_tokens == full.engine.spec_stats.verified_tokens


@pytest.mark.parametrize("skip_every,budget", [(2, 1000), (3, 2), (1, 1000)])
def test_greedy_lossless_when_requests_skip_the_drafter(tmp_path_factory, target_dir, reference,
                                                        skip_every, budget):
    """Requests the plan leaves undrafted decode one plain token in the same step; the drafter's
    context still advances over it, so the next drafted round is as good as ever."""
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    prompts, params = workload(16)
    llm = make_llm(target_dir, d, max_num_batched_tokens=64)
    forced(llm, budget, skip_every)
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    stats = llm.engine.spec_stats
    assert stats.undrafted_steps > 0
    assert stats.draft_rounds == (0 if skip_every == 1 else stats.draft_rounds)
    assert stats.drafted_tokens == stats.draft_rounds * 4
    if skip_every == 2:          # drafted rounds still accept (the context was kept current)
        assert stats.accepted_tokens > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_budgeted_steps_staggered_and_preempted(tmp_path_factory, target_dir, reference):
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    prompts, params = workload(16)
    llm = make_llm(target_dir, d, kv_tokens=160, max_num_batched_tokens=48, max_model_len=128)
    forced(llm, 3)
    assert run_staggered(llm, prompts, params) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_budgeted_steps_beside_prefill_chunks_and_plain_rows(tmp_path_factory, target_dir, reference,
                                                             monkeypatch):
    """Staggered arrivals put prefill chunks of 16+ tokens beside undrafted one-token rows and
    trimmed blocks: the step's attention runs in two groups (decode and verify rows; prefill
    chunks), and cutting blocks to their verify lengths leaves the prefill chunks whole."""
    import dspark.worker.worker as worker_module
    from dspark.worker.inputs import SPLIT_MIN_Q
    trimmed = Counter()
    original = worker_module._trimmed

    def counting(batch, spec_idx, verify_lens):
        out = original(batch, spec_idx, verify_lens)
        prefill = [c for c in batch.chunks if len(c.token_ids) >= SPLIT_MIN_Q and c.num_logits <= 1]
        trimmed["with prefill" if prefill else "decode and verify"] += 1
        assert all(c in out.chunks for c in prefill)
        return out

    monkeypatch.setattr(worker_module, "_trimmed", counting)
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    prompts, params = workload(16)
    llm = make_llm(target_dir, d, max_num_batched_tokens=64)
    forced(llm, 3, skip_every=3)
    assert run_staggered(llm, prompts, params) == reference
    assert trimmed["with prefill"] > 0 and trimmed["decode and verify"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("budget,skip_every", [(1, 0), (2, 0), (2, 2)])
def test_sampling_lossless_under_a_budget(tmp_path_factory, budget, skip_every):
    target = tmp_path_factory.mktemp("small_target")
    save_tiny(str(target), "llama", tied=True, vocab=12, num_hidden_layers=4, seed=2)
    d = tmp_path_factory.mktemp("small_drafter")
    save_random_drafter(str(d), str(target), gamma=3, copy_prev=1.0)
    n, prompt = 3000, [3, 5, 7]

    def dist(drafter_dir, force):
        llm = LLM(str(target), dtype="float32", drafter=drafter_dir, max_model_len=64, max_num_seqs=256,
                  graph="eager")
        if force is not None:
            forced(llm, force, skip_every)
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
        return Counter(tuple(o.token_ids) for o in llm.generate([prompt] * n, params)), llm

    spec, llm = dist(str(d), budget)
    plain, _ = dist(None, None)
    assert 0 < llm.engine.spec_stats.verified_tokens < llm.engine.spec_stats.drafted_tokens
    assert (llm.engine.spec_stats.undrafted_steps > 0) == (skip_every > 0)
    support = set(spec) | set(plain)
    tv = 0.5 * sum(abs(spec[k] - plain[k]) / n for k in support)
    assert tv < 1.5 * math.sqrt(len(support) / n)


def test_planner_in_the_loop_is_lossless(tmp_path_factory, target_dir, reference):
    """The real planner with a cost table measured at start-up."""
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    prompts, params = workload(16)
    llm = make_llm(target_dir, d, max_num_batched_tokens=64, max_num_seqs=16,
                   spec_schedule="confidence", cost_table="auto", min_gain=0.0)
    table = llm.engine.policy.table
    assert table.max_tokens == 64 and table.max_requests == 16
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    assert llm.engine.policy.requests == {}              # finished requests leave no state behind


def test_lossless_whatever_the_acceptance_model_predicts(tmp_path_factory, target_dir, reference):
    """Predicted acceptance replaced by random numbers each step: plans swing between drafting,
    trimming and plain decoding, and the output stays the target's."""
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    prompts, params = workload(16)
    llm = make_llm(target_dir, d, max_num_batched_tokens=64, max_num_seqs=16,
                   spec_schedule="confidence", cost_table="auto", min_gain=0.0)
    g = torch.Generator().manual_seed(0)
    llm.engine.policy.acceptance.predict = lambda x: torch.rand(x.shape, generator=g).double().numpy() ** 3
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    stats = llm.engine.spec_stats
    assert stats.draft_rounds > 0 and stats.undrafted_steps > 0


def test_a_steep_cost_table_trims_verification_losslessly(tmp_path_factory, target_dir, reference):
    """Each verified token costs 10x a step's floor: the planner verifies fewer drafts than
    verify-all does, and the output does not change."""
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    prompts, params = workload(16)
    full = make_llm(target_dir, d, max_num_batched_tokens=64, max_num_seqs=16, spec_schedule="verify-all")
    assert [o.token_ids for o in full.generate(prompts, params)] == reference
    path = str(tmp_path_factory.mktemp("cost") / "cost.json")
    CostTable(fingerprint=full.engine.cost_fingerprint(),
              verify_ms=[0.0] + [1.0 + 10.0 * t for t in range(1, 65)],
              draft_ms=[0.0] + [1.0] * 16).save(path)
    llm = make_llm(target_dir, d, max_num_batched_tokens=64, max_num_seqs=16,
                   spec_schedule="confidence", cost_table=path, confidence_lag=1)
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    trimmed, verify_all = llm.engine.spec_stats, full.engine.spec_stats
    assert 0 < trimmed.verified_tokens < verify_all.verified_tokens
    assert trimmed.accepted_tokens <= verify_all.accepted_tokens


def test_drafting_that_cannot_pay_is_skipped_and_free_drafting_verifies_everything(
        tmp_path_factory, target_dir, reference):
    """A drafter pass priced at 100 target steps per request: the policy decodes plainly and the
    drafter is never called. A free drafter and a flat target cost: every request drafts every
    step and every draft is verified, as verify-all does. The texts are the reference's."""
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    prompts, params = workload(16)

    def run(draft_ms: float):
        probe = make_llm(target_dir, d, max_num_batched_tokens=64, max_num_seqs=16)
        path = str(tmp_path_factory.mktemp("cost") / "cost.json")
        CostTable(fingerprint=probe.engine.cost_fingerprint(), verify_ms=[0.0] + [10.0] * 64,
                  draft_ms=[0.0] + [draft_ms * r for r in range(1, 17)]).save(path)
        llm = make_llm(target_dir, d, max_num_batched_tokens=64, max_num_seqs=16,
                       spec_schedule="confidence", cost_table=path)
        passes = counting_drafter_passes(llm)
        assert [o.token_ids for o in llm.generate(prompts, params)] == reference
        return llm.engine.spec_stats, len(passes)

    (dear, dear_passes), (free, free_passes) = run(1000.0), run(1e-6)
    assert dear.draft_rounds == 0 and dear.undrafted_steps > 0 and dear_passes == 0
    full = make_llm(target_dir, d, max_num_batched_tokens=64, max_num_seqs=16, spec_schedule="verify-all")
    full.generate(prompts, params)
    assert free.undrafted_steps == 0 and free_passes > 0
    assert (free.draft_rounds, free.verified_tokens) == (full.engine.spec_stats.draft_rounds,
                                                         full.engine.spec_stats.verified_tokens)


def test_schedule_configuration_errors(tmp_path_factory, target_dir):
    d = drafter(tmp_path_factory, target_dir, gamma=4)
    with pytest.raises(ValueError, match="spec_schedule must be one of"):
        make_llm(target_dir, d, spec_schedule="sometimes")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_llm(target_dir, d, cost_table="/nonexistent/cost.json")
    with pytest.raises(ValueError, match="only applies to spec_schedule='confidence'"):
        make_llm(target_dir, d, spec_schedule="verify-all", cost_table="auto")
    assert make_llm(target_dir, None).engine.policy is None   # plain: nothing to plan
    path = str(tmp_path_factory.mktemp("cost") / "cost.json")
    CostTable(fingerprint={"device": "cpu", "model": "another"}, verify_ms=[0, 1.0, 2.0],
              draft_ms=[0, 1.0]).save(path)
    with pytest.raises(ValueError, match="model: table has 'another'"):
        make_llm(target_dir, d, spec_schedule="confidence", cost_table=path)
