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

    def plan(self, scheduled, joining_tokens=0):
        spec = [s for s in scheduled if s.spec]
        if not spec:
            return None
        drafted = []
        for _ in spec:
            self.seen += 1
            drafted.append(not (self.skip_every and self.seen % self.skip_every == 0))
        caps = sum(s.verify_len for s, d in zip(spec, drafted) if d)
        if caps:
            self.steps.append(min(self.budget_value, caps))
        return StepPlan(drafted=drafted, budget=self.budget_value, full=len(spec) * 1000)

    def record(self, seq, z, verified, accepted):
        pass

    def observe_step(self, tokens, draft_requests, measured_ms):
        pass


def forced(llm, budget: int, skip_every: int = 0) -> ForcedBudget:
    llm.engine.confidence_scheduler = ForcedBudget(budget, skip_every)
    return llm.engine.confidence_scheduler


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
    chunks), trimming drops draft rows from the first alone and renumbers both."""
    import dspark.worker.ragged as ragged
    from dspark.worker.inputs import SPLIT_MIN_Q
    trimmed = Counter()
    original = ragged._trim_part

    def counting(part, keep, new_row, num_dropped):
        prefill = part.meta.max_q >= SPLIT_MIN_Q
        trimmed["prefill" if prefill else "decode and verify"] += 1
        assert num_dropped == 0 or not prefill
        return original(part, keep, new_row, num_dropped)

    monkeypatch.setattr(ragged, "_trim_part", counting)
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    prompts, params = workload(16)
    llm = make_llm(target_dir, d, max_num_batched_tokens=64)
    forced(llm, 3, skip_every=3)
    assert run_staggered(llm, prompts, params) == reference
    assert trimmed["prefill"] > 0 and trimmed["decode and verify"] == trimmed["prefill"]


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
    table = llm.engine.confidence_scheduler.table
    assert table.max_tokens == 64 and table.max_requests == 16
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    assert llm.engine.worker.trim_fallbacks == 0
    steps = llm.engine.confidence_scheduler.cost_correction.steps     # every step was timed
    rounds = llm.engine.spec_stats.draft_rounds
    assert 0 < int(steps[1].sum()) <= rounds and int(steps[0].sum()) > 0      # drafted, plain


def test_lossless_whatever_the_cost_correction_learns(tmp_path_factory, target_dir, reference):
    """Step times fed to the cost correction scaled by random factors (0.05x to 20x): plans swing
    between drafting, trimming and plain decoding, and the output stays the target's."""
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    prompts, params = workload(16)
    llm = make_llm(target_dir, d, max_num_batched_tokens=64, max_num_seqs=16,
                   spec_schedule="confidence", cost_table="auto", min_gain=0.0)
    corr = llm.engine.confidence_scheduler.cost_correction
    observe, g = corr.observe, torch.Generator().manual_seed(0)

    def skewed(tokens, drafted, predicted_ms, measured_ms):
        factor = float(20.0 ** (2 * torch.rand(1, generator=g) - 1))
        observe(tokens, drafted, predicted_ms, measured_ms * factor)

    corr.observe = skewed
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
    llm = make_llm(target_dir, d, max_num_batched_tokens=64, max_num_seqs=16,    # the table's word
                   spec_schedule="confidence", cost_table=path, confidence_lag=1, cost_correction=False)
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    trimmed, verify_all = llm.engine.spec_stats, full.engine.spec_stats
    assert 0 < trimmed.verified_tokens < verify_all.verified_tokens
    assert trimmed.accepted_tokens <= verify_all.accepted_tokens


def test_drafting_that_cannot_pay_is_skipped(tmp_path_factory, target_dir, reference):
    """A drafter pass priced at 100 target steps per request: the planner decodes plainly, and
    no probe runs, since not even certain drafts could pay for one (each is counted as declined);
    a free drafter is never skipped. The texts are the reference's either way."""
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    prompts, params = workload(16)

    def run(draft_ms: float):
        probe = make_llm(target_dir, d, max_num_batched_tokens=64, max_num_seqs=16)
        path = str(tmp_path_factory.mktemp("cost") / "cost.json")
        CostTable(fingerprint=probe.engine.cost_fingerprint(), verify_ms=[0.0] + [10.0] * 64,
                  draft_ms=[0.0] + [draft_ms * r for r in range(1, 17)]).save(path)
        llm = make_llm(target_dir, d, max_num_batched_tokens=64, max_num_seqs=16,
                       spec_schedule="confidence", cost_table=path, probe_interval=4,
                       cost_correction=False)           # the table's word, not the tiny model's
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == reference
        return llm.engine.spec_stats, llm.engine.confidence_scheduler

    (dear, dear_sched), (free, free_sched) = run(1000.0), run(1e-6)
    assert free.undrafted_steps == 0 and free.draft_rounds > 0 and free_sched.declined_probes == 0
    assert dear.draft_rounds == 0 and dear.undrafted_steps > 0 and dear_sched.declined_probes > 0


def _population(sched, rounds: int, accepted: list[int]) -> None:
    """Teach the scheduler's population `rounds` verified rounds of 2 drafts, cycling through
    the accepted counts given."""
    for i in range(rounds):
        sched.correction.observe([0.5, 0.25], verified=2, accepted=accepted[i % len(accepted)])


def test_futile_probes_double_the_probe_interval():
    """Hopeless requests in a population whose average round would pay: each drafts after going
    its probe interval undrafted, an interval that doubles after every probe that does not
    convince the planner (up to 16x). (Their own evidence does not fade here: a half-life of
    fading toward the population's average would bring them back on its own.)"""
    from types import SimpleNamespace
    from dspark.engine.spec_schedule import ConfidenceScheduler
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 4 + [13.0] * 8, draft_ms=[0.0] + [1.0] * 4)
    hopeless = [-9.0, -9.0]
    sched = ConfidenceScheduler(table, None, gamma=2, lag=1, min_gain=0.05, probe_interval=4,
                                half_life=1e9, cost_correction=False)
    _population(sched, 200, [2, 2, 1, 0, 0])                     # realises about [0.6, 0.4]
    seqs = [SimpleNamespace(generator=None, survival_history=[sched.survival_of(hopeless)], steps_without_draft=0,
                            probe_backoff=1, planned_survival=None) for _ in range(4)]
    batch = [SimpleNamespace(seq=s, spec=True, sample=True, verify_len=2, num_new_tokens=3) for s in seqs]
    pattern = []
    for _ in range(200):
        pattern.append(sched.plan(batch).drafted)
        for s, drafted in zip(seqs, pattern[-1]):
            if drafted:
                sched.record(s, hopeless, verified=2, accepted=0)
    expected, run, interval = [], 0, 4                    # U x4, D, U x8, D, U x16, D, ...
    for _ in range(200):
        if run >= interval:
            expected.append(True)
            run, interval = 0, min(2 * interval, 4 * 16)
        else:
            expected.append(False)
            run += 1
    assert [step[0] for step in pattern] == expected and all(len(set(step)) == 1 for step in pattern)
    assert sched.declined_probes == 0


def test_schedule_configuration_errors(tmp_path_factory, target_dir):
    d = drafter(tmp_path_factory, target_dir, gamma=4)
    with pytest.raises(ValueError, match="spec_schedule must be one of"):
        make_llm(target_dir, d, spec_schedule="sometimes")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_llm(target_dir, d, cost_table="/nonexistent/cost.json")
    with pytest.raises(ValueError, match="only applies to spec_schedule='confidence'"):
        make_llm(target_dir, d, spec_schedule="verify-all", cost_table="auto")
    assert make_llm(target_dir, None).engine.confidence_scheduler is None   # plain: nothing to plan
    path = str(tmp_path_factory.mktemp("cost") / "cost.json")
    CostTable(fingerprint={"device": "cpu", "model": "another"}, verify_ms=[0, 1.0, 2.0],
              draft_ms=[0, 1.0]).save(path)
    with pytest.raises(ValueError, match="model: table has 'another'"):
        make_llm(target_dir, d, spec_schedule="confidence", cost_table=path)


def test_online_correction_learns_what_rounds_really_accept():
    """A head that promises every draft but whose drafts are never accepted: the correction
    drives predicted survival to ~0; one that delivers what it promises keeps factor ~1."""
    from dspark.spec.online_correction import OnlineSurvivalCorrection
    gamma = 4
    promise = torch.tensor([0.9, 0.8, 0.7, 0.6])
    liar, honest = OnlineSurvivalCorrection(gamma), OnlineSurvivalCorrection(gamma)
    for i in range(400):
        liar.observe(promise, verified=gamma, accepted=0)
        honest.observe(promise, verified=gamma, accepted=4 if i % 10 < 6 else (3 if i % 10 < 7 else 0))
    assert liar.apply(promise).max() < 0.05
    corrected = honest.apply(promise)
    assert (corrected[1:] <= corrected[:-1]).all() and corrected.max() <= 1.0
    assert abs(float(corrected[0]) - 0.7) < 0.1          # realised: 70% of rounds accept position 1
    before = liar.predicted.copy()
    liar.observe(promise, verified=0, accepted=0)         # a round that verified nothing: no evidence
    assert (liar.predicted == before).all()


def test_population_survival_starts_certain_and_learns():
    """With no rounds the population prior is 1 (a request without history counts as certain);
    after rounds that accept position 1 half the time and position 2 never, it says so."""
    from dspark.spec.online_correction import OnlineSurvivalCorrection
    corr = OnlineSurvivalCorrection(3)
    assert (corr.realised_survival == 1.0).all()
    for i in range(2000):
        corr.observe(torch.full((3,), 0.5), verified=3, accepted=i % 2)
    assert corr.realised_survival == pytest.approx([0.5, 0.0, 0.0], abs=0.02)


def test_old_confidences_fade_toward_the_population_prior():
    """A request whose last round was hopeless is priced at its own survival right after that
    round, and closer to what the population realises the longer it goes undrafted."""
    from types import SimpleNamespace
    from dspark.engine.spec_schedule import ConfidenceScheduler
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 16, draft_ms=[0.0, 1.0, 2.0])
    sched = ConfidenceScheduler(table, None, gamma=2, lag=1, half_life=2.0)
    for _ in range(200):                          # the population accepts both drafts
        sched.correction.observe(torch.ones(2), verified=2, accepted=2)

    def priced(age: int, history: list) -> torch.Tensor:
        seq = SimpleNamespace(generator=None, survival_history=[sched.survival_of(z) for z in history],
                              steps_without_draft=age)
        return torch.from_numpy(sched._stale_survival([SimpleNamespace(seq=seq, verify_len=2)])[0])

    hopeless = [[-30.0, -30.0]]
    fresh, half, old = priced(0, hopeless), priced(2, hopeless), priced(40, hopeless)
    assert fresh.max() < 1e-6
    population = torch.tensor(sched.correction.realised_survival)
    assert torch.allclose(half, torch.full((2,), 0.5 * float(population[0]), dtype=half.dtype), atol=1e-3)
    assert torch.allclose(old, population, atol=1e-3)
    assert torch.allclose(priced(0, []), population)                       # no history at all


def test_the_planner_learns_what_its_own_prices_realise():
    """Stale confidences promise two sure drafts, while the rounds they buy accept none and the
    fresh confidences of those rounds say so honestly: the drafter's calibration has nothing
    to correct, but the planner's own correction learns that its prices do not come true and it
    decodes plainly. Prices that do come true keep it drafting."""
    from types import SimpleNamespace
    from dspark.engine.spec_schedule import ConfidenceScheduler
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 4 + [11.0] * 8, draft_ms=[0.0] + [1.0] * 4)
    sure, hopeless = [9.0, 9.0], [-9.0, -9.0]

    def run(accepted: int) -> tuple[ConfidenceScheduler, StepPlan]:
        sched = ConfidenceScheduler(table, None, gamma=2, lag=2, min_gain=0.0, probe_interval=10**6,
                                    cost_correction=False)
        batch = [SimpleNamespace(seq=SimpleNamespace(generator=None,
            survival_history=[sched.survival_of(sure), sched.survival_of(hopeless)],
            steps_without_draft=0, probe_backoff=1,
            planned_survival=None), spec=True, sample=True, verify_len=2, num_new_tokens=3)
            for _ in range(4)]                           # lag 2: priced by `sure`
        assert all(sched.plan(batch).drafted)
        for _ in range(60):
            for s in batch:
                if s.seq.planned_survival is not None:
                    sched.record(s.seq, hopeless, verified=2, accepted=accepted)
                    s.seq.survival_history[:] = [sched.survival_of(sure), sched.survival_of(hopeless)]
            sched.plan(batch)
        return sched, sched.plan(batch)

    (liar, plain), (honest, drafted) = run(accepted=0), run(accepted=2)
    assert liar.correction.factors.min() > 0.9          # the fresh confidences were right
    assert liar.plan_correction.factors.max() < 0.3
    assert not any(plain.drafted) and plain.budget == 0
    assert all(drafted.drafted) and drafted.budget == 8
    assert honest.plan_correction.factors.min() > 0.9


def test_a_probe_runs_only_when_a_good_case_pays():
    """On a staircase where verifying past 4 tokens costs the next bucket, a single request due
    a probe cannot pay for that bucket even if it were as good as the population's average round
    (here: both drafts always accepted): the probe waits and is counted as declined. Two due
    requests together fill the bucket well enough: both probe. A population whose average round
    would not pay for them gives no probe a case."""
    from types import SimpleNamespace
    from dspark.engine.spec_schedule import ConfidenceScheduler
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 4 + [14.0] * 8, draft_ms=[0.0] + [1.0] * 4)
    hopeless = [-9.0, -9.0]

    def plan(due: int, accepted: list[int]) -> tuple[ConfidenceScheduler, StepPlan, list]:
        sched = ConfidenceScheduler(table, None, gamma=2, lag=1, min_gain=0.05, probe_interval=4,
                                    half_life=1e9, cost_correction=False)
        _population(sched, 200, accepted)
        seqs = [SimpleNamespace(generator=None, survival_history=[sched.survival_of(hopeless)],
                                steps_without_draft=4 if i < due else 0, probe_backoff=1,
                                planned_survival=None) for i in range(4)]
        batch = [SimpleNamespace(seq=s, spec=True, sample=True, verify_len=2, num_new_tokens=3)
                 for s in seqs]
        return sched, sched.plan(batch), seqs

    good = [2]                                            # realises [1, 1]
    lone, lone_plan, lone_seqs = plan(1, good)
    assert not any(lone_plan.drafted) and lone.declined_probes == 1
    assert lone_seqs[0].steps_without_draft == 5 and lone_seqs[0].probe_backoff == 1   # still due
    pair, pair_plan, pair_seqs = plan(2, good)
    assert pair_plan.drafted == [True, True, False, False] and pair.declined_probes == 0
    assert pair_seqs[0].steps_without_draft == 0 and pair_seqs[0].probe_backoff == 2  # futile: backs off
    barren, barren_plan, _ = plan(4, [0])
    assert not any(barren_plan.drafted) and barren.declined_probes == 4
    middling, middling_plan, _ = plan(2, [2, 1, 0, 0])         # realises [0.5, 0.25]: a pair cannot pay
    assert not any(middling_plan.drafted) and middling.declined_probes == 2


def test_the_scheduler_prices_drafts_on_top_of_the_prefill_that_joins():
    """The same requests and confidences draft in a decode step whose bucket has room, and
    decode plainly when a prefill joins and every draft would add target time."""
    from types import SimpleNamespace
    from dspark.engine.spec_schedule import ConfidenceScheduler
    verify = [0.0] + [10.0] * 8 + [10.0 + 2.0 * t for t in range(1, 120)]   # 2 ms a token past 8
    table = CostTable(fingerprint={}, verify_ms=verify, draft_ms=[0.0] + [1.0] * 4)
    z = math.log(0.3 / 0.7)                               # c = 0.3: survival [0.3, 0.09]
    sched = ConfidenceScheduler(table, None, gamma=2, lag=1, min_gain=0.05, probe_interval=10**6,
                                cost_correction=False)
    batch = [SimpleNamespace(seq=SimpleNamespace(generator=None, survival_history=[sched.survival_of([z, z])],
                                                 steps_without_draft=0,
                                                 probe_backoff=1, planned_survival=None),
                             spec=True, sample=True, verify_len=2, num_new_tokens=3) for _ in range(4)]
    alone = sched.plan(batch)
    assert all(alone.drafted) and alone.budget == 4       # 4 + 4 tokens: the same 10 ms
    joined = sched.plan(batch, joining_tokens=60)
    assert not any(joined.drafted) and joined.budget == 0
