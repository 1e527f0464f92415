"""The speculation policy's decisions, on its own: what it learns from rounds, how it prices
requests it has not drafted lately, and that it never stops trying for good."""

import math

import numpy as np
import pytest

from dspark.spec.planner import CostTable, StepPlan
from dspark.spec import policy as policy_module
from dspark.spec.policy import MAX_TRIALS, AcceptanceModel, Candidate, SpecPolicy, StepContext

# batch 1 on a cheap drafter: drafting pays when the first draft is accepted over ~25% of rounds
TABLE = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 4 + [11.0] * 8, draft_ms=[0.0] + [2.0] * 4)


def logit(c: float) -> float:
    return math.log(c / (1 - c))


def test_with_no_rounds_the_calibrated_confidences_are_trusted_and_the_population_is_certain():
    model = AcceptanceModel(3)
    x = np.array([[0.8, 0.4, 0.1], [0.3, 0.2, 0.0]])
    assert np.allclose(model.predict(x), x)
    assert (model.mean == 1.0).all()


def test_a_head_whose_promises_never_come_true_is_priced_at_nothing():
    model = AcceptanceModel(2)
    for _ in range(300):
        model.observe(np.array([0.9, 0.8]), verified=2, accepted=0)
    assert model.predict(np.array([[0.9, 0.8]])).max() < 0.05
    assert model.mean.max() < 0.05
    before = model.sums.copy()
    model.observe(np.array([0.9, 0.8]), verified=0, accepted=0)     # verified nothing: no evidence
    assert (model.sums == before).all()


def test_selecting_rounds_by_their_price_does_not_bias_what_unselected_prices_predict():
    """Acceptance is 0.1 + 0.6 x at position 1. Rounds observed only where the price x > 0.6
    (the ones a planner drafts) still predict a round priced at 0.2 right: a ratio of realised
    over priced learned on those rounds would price it at about 0.2 * 0.7 / 0.8."""
    rng = np.random.default_rng(0)
    model = AcceptanceModel(1, round_decay=1.0)
    for _ in range(20000):
        x = rng.uniform(0.6, 1.0)
        model.observe(np.array([x]), verified=1, accepted=int(rng.uniform() < 0.1 + 0.6 * x))
    assert model.predict(np.array([[0.2]]))[0, 0] == pytest.approx(0.22, abs=0.03)
    assert model.predict(np.array([[0.9]]))[0, 0] == pytest.approx(0.64, abs=0.03)


def test_confidences_that_predict_nothing_price_every_request_at_the_mean():
    rng = np.random.default_rng(1)
    model = AcceptanceModel(1)
    for _ in range(5000):
        model.observe(np.array([rng.uniform()]), verified=1, accepted=int(rng.uniform() < 0.4))
    predicted = model.predict(np.array([[0.05], [0.95]]))[:, 0]
    assert predicted == pytest.approx([0.4, 0.4], abs=0.05)


def test_old_confidences_fade_toward_the_population_mean():
    """A request priced hopeless by its last round, in a population that accepts half of its
    first drafts: right after the round it is hopeless, two undrafted steps later (one
    half-life) half way, much later at the population's mean; with no history, at the mean."""
    policy = SpecPolicy(TABLE, None, gamma=2, lag=1, half_life=2.0, evidence_half_life=1e9)
    for i in range(400):
        policy.acceptance.observe(None, verified=2, accepted=i % 2)
    policy.record("a", [-30.0, -30.0], verified=2, accepted=0)
    mean = policy.acceptance.mean

    def priced(age: int, request_id: str = "a") -> np.ndarray:
        state = policy._state(request_id)
        state.last_drafted = policy.steps - age
        return policy._prices([Candidate(request_id, 2)], [state])[1][0]

    assert priced(0).max() < 1e-3
    assert priced(2) == pytest.approx(0.5 * mean, abs=1e-3)
    assert priced(60) == pytest.approx(mean, abs=1e-3)
    assert priced(0, "new") == pytest.approx(mean)


def test_bad_early_rounds_do_not_stop_drafting_for_good():
    """Forty rounds that accepted nothing: the policy stops drafting, and as that evidence ages
    (no round observed meanwhile) it drafts again on its own, so a drafter that got better is
    found out."""
    policy = SpecPolicy(TABLE, None, gamma=2, lag=1, evidence_half_life=16.0)
    step = StepContext(other_tokens=1, num_sampling=1)
    for _ in range(40):
        policy.acceptance.observe(None, verified=2, accepted=0)
    waited = 0
    while not policy.plan([Candidate("new", 2)], step).drafted[0]:
        waited += 1
        assert waited < 200
    assert waited > 10


def trials_of_a_hopeless_drafter(policy: SpecPolicy, steps: int) -> int:
    """Rounds a lone request drafts over `steps` priced steps when every round accepts nothing."""
    step, drafted = StepContext(other_tokens=1, num_sampling=1), 0
    for _ in range(steps):
        if policy.plan([Candidate("a", 2)], step).drafted[0]:
            drafted += 1
            policy.record("a", [-30.0, -30.0], verified=2, accepted=0)
    return drafted


def test_trials_that_keep_failing_grow_rare_and_one_that_pays_resets_them(monkeypatch):
    """A drafter that never delivers: after each trial the next plan does not draft the request
    again, so the evidence half-life doubles, up to 16 times, and trials grow rare (without the
    backoff, every few steps as the request's own evidence fades). A trial after which the
    request goes on drafting brings back the base. (Plans priced every step: a kept plan drafts
    without a trial.)"""
    make = lambda: SpecPolicy(TABLE, None, gamma=2, lag=1, evidence_half_life=16.0, max_kept=0)  # noqa: E731
    policy = make()
    backed_off = trials_of_a_hopeless_drafter(policy, 3000)
    assert policy.backoff == 16 and policy.fade == pytest.approx(0.5 ** (1 / 256))
    monkeypatch.setattr(policy_module, "MAX_BACKOFF", 1)
    assert backed_off < 0.25 * trials_of_a_hopeless_drafter(make(), 3000)
    monkeypatch.undo()
    step = StepContext(other_tokens=1, num_sampling=1)
    while not policy.plan([Candidate("a", 2)], step).drafted[0]:
        pass
    policy.record("a", [logit(0.99), logit(0.99)], verified=2, accepted=2)
    assert policy.plan([Candidate("a", 2)], step).drafted == [True]
    assert policy.backoff == 1 and policy.fade == pytest.approx(0.5 ** (1 / 16))


def test_no_trial_rides_on_a_prefill():
    """A request without evidence of its own may try drafting in a decode step, not in one a
    prefill joins (that step is priced by its slope, but costs the batch a long step)."""
    policy = SpecPolicy(TABLE, None, gamma=2, lag=1, min_gain=0.0, max_kept=0)
    for _ in range(50):
        policy.acceptance.observe(None, verified=2, accepted=2)
    joined = policy.plan([Candidate("new", 2)], StepContext(other_tokens=1, num_sampling=1, joining_tokens=8))
    assert not any(joined.drafted)
    assert policy.plan([Candidate("new", 2)], StepContext(other_tokens=1, num_sampling=1)).drafted == [True]


def test_requests_are_forgotten_and_a_plan_reports_what_it_expects():
    policy = SpecPolicy(TABLE, None, gamma=2, lag=1, min_gain=0.0)
    sure = [logit(0.99), logit(0.99)]
    for rid in ("a", "b"):
        policy.record(rid, sure, verified=2, accepted=2)
    plan = policy.plan([Candidate("a", 2), Candidate("b", 2)], StepContext(other_tokens=2, num_sampling=2))
    assert all(plan.drafted) and plan.budget == 4
    assert plan.predicted_accepted == pytest.approx(4 * 0.99 ** 2, rel=0.05)
    policy.forget("a")
    assert set(policy.requests) == {"b"}


def test_with_a_cap_of_one_requests_without_fresh_evidence_are_tried_one_at_a_time():
    """New requests where drafting pays: one step tries the one with the fewest held context
    rows, the next adds another beside it (the first now has rounds of its own)."""
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 40, draft_ms=[0.0] + [2.0 * r for r in range(1, 9)])
    policy = SpecPolicy(table, None, gamma=2, lag=1, max_kept=0)
    policy.max_trials = 1
    batch = [Candidate(rid, 2, context_len=n) for rid, n in zip("abcd", (300, 100, 200, 50))]
    step = StepContext(other_tokens=4, num_sampling=4)
    assert policy.plan(batch, step).drafted == [False, False, False, True]
    policy.record("d", [logit(0.99)] * 2, verified=2, accepted=2)
    assert policy.plan(batch, step).drafted == [False, True, False, True]


def test_at_most_max_trials_new_requests_try_in_one_step_and_no_cap_lets_all_try():
    """Past the cap, the requests holding the fewest context rows try (all priced alike)."""
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 80, draft_ms=[0.0] + [2.0 * r for r in range(1, 13)])
    held = (300, 100, 200, 50, 400, 150, 250, 20)
    batch = [Candidate(f"r{i}", 2, context_len=n) for i, n in enumerate(held)]
    step = StepContext(other_tokens=8, num_sampling=8)
    capped = SpecPolicy(table, None, gamma=2, lag=1, max_kept=0)
    assert capped.max_trials == MAX_TRIALS < len(batch)
    fewest = sorted(range(len(held)), key=held.__getitem__)[:MAX_TRIALS]
    assert capped.plan(batch, step).drafted == [i in fewest for i in range(len(held))]
    uncapped = SpecPolicy(table, None, gamma=2, lag=1, max_kept=0)
    uncapped.max_trials = 0
    assert uncapped.plan(batch, step).drafted == [True] * len(held)


def test_requests_without_evidence_of_their_own_are_priced_at_the_population_and_tried_together():
    """By default the same new requests all draft in one step (none in a step a prefill joins),
    priced at the population's acceptance."""
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 40, draft_ms=[0.0] + [2.0 * r for r in range(1, 9)])
    policy = SpecPolicy(table, None, gamma=2, lag=1, max_kept=0)
    batch = [Candidate(rid, 2, context_len=n) for rid, n in zip("abcd", (300, 100, 200, 50))]
    assert policy.plan(batch, StepContext(other_tokens=4, num_sampling=4)).drafted == [True] * 4
    joined = policy.plan(batch, StepContext(other_tokens=4, num_sampling=4, joining_tokens=8))
    assert not any(joined.drafted[i] for i in (0, 1, 2))       # d drafted last step: fresh evidence


def test_held_context_rows_are_paid_for_over_the_rounds_a_request_has_left():
    """200 held rows at 0.1 ms each: a new request with hundreds of tokens to go drafts (its
    later rounds share the append), one about to finish decodes plainly; a request that drafted
    last step holds nothing, and the plan reports what the drafted requests' rows cost."""
    table = CostTable(fingerprint={}, verify_ms=TABLE.verify_ms, draft_ms=TABLE.draft_ms, held_row_ms=0.1)
    step = StepContext(other_tokens=1, num_sampling=1)
    ending = SpecPolicy(table, None, gamma=2, lag=1, max_kept=0)
    assert not ending.plan([Candidate("a", 2, context_len=200, remaining=2)], step).drafted[0]
    policy = SpecPolicy(table, None, gamma=2, lag=1, max_kept=0)
    plan = policy.plan([Candidate("a", 2, context_len=200, remaining=500)], step)
    assert plan.drafted[0] and plan.held_ms == pytest.approx(20.0)
    plan = policy.plan([Candidate("a", 2, context_len=203, remaining=2)], step)
    assert plan.drafted[0] and plan.held_ms == 0.0


def test_drafts_are_priced_on_top_of_the_prefill_that_joins():
    """The same requests and confidences draft in a decode step whose bucket has room, and
    decode plainly when a prefill joins and every draft would add target time."""
    verify = [0.0] + [10.0] * 8 + [10.0 + 2.0 * t for t in range(1, 120)]   # 2 ms a token past 8
    table = CostTable(fingerprint={}, verify_ms=verify, draft_ms=[0.0] + [1.0] * 4)
    policy = SpecPolicy(table, None, gamma=2, lag=1, min_gain=0.05)
    z = logit(0.3)                                        # c = 0.3: survival [0.3, 0.09]
    for rid in "abcd":
        policy.record(rid, [z, z], verified=0, accepted=0)
    batch = [Candidate(rid, 2) for rid in "abcd"]
    alone = policy.plan(batch, StepContext(other_tokens=4, num_sampling=4))
    assert all(alone.drafted) and alone.budget == 4       # 4 + 4 tokens: the same 10 ms
    joined = policy.plan(batch, StepContext(other_tokens=4, num_sampling=4, joining_tokens=60))
    assert not any(joined.drafted) and joined.budget == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="lag"):
        SpecPolicy(TABLE, None, gamma=2, lag=0)
    with pytest.raises(ValueError, match="half-lives"):
        SpecPolicy(TABLE, None, gamma=2, evidence_half_life=0.0)


def test_only_steps_the_table_does_not_reach_are_warned_about(caplog):
    """A prefill joining the step is priced on top along the table's slope, as designed: no
    warning. More requests than the table holds: one warning, every such step counted."""
    policy = SpecPolicy(TABLE, None, gamma=2, lag=1, max_kept=0)
    with caplog.at_level("WARNING", logger="dspark.spec.policy"):
        policy.plan([Candidate("a", 2)], StepContext(other_tokens=1, num_sampling=1, joining_tokens=500))
        assert policy.oversize_steps == 0 and not caplog.records
        many = [Candidate(str(i), 2) for i in range(6)]
        for _ in range(2):
            policy.plan(many, StepContext(other_tokens=6, num_sampling=6))
    assert policy.oversize_steps == 2 and len(caplog.records) == 1


def test_a_plan_that_drafts_nothing_is_kept_for_longer_stretches_until_fewer_requests_run():
    """Drafting never pays: kept stretches of 1, 2, 4 steps follow the priced plans, then of
    max_kept = 4; a step with fewer candidates is priced at once, and no kept step drafts."""
    policy = SpecPolicy(TABLE, None, gamma=2, lag=1, max_kept=4, evidence_half_life=1e9)
    for _ in range(300):
        policy.acceptance.observe(None, verified=2, accepted=0)
    two = [Candidate("a", 2), Candidate("b", 2)]
    step = StepContext(other_tokens=2, num_sampling=2)
    priced = []
    for i in range(1, 17):
        kept = policy.kept_plans
        plan = policy.plan(two, step)
        assert not any(plan.drafted) and plan.budget == 0 and plan.full == 4
        if policy.kept_plans == kept:
            priced.append(i)
    assert priced == [1, 3, 6, 11, 16]
    kept = policy.kept_plans
    policy.plan(two[:1], StepContext(other_tokens=1, num_sampling=1))
    assert policy.kept_plans == kept                       # fewer candidates: priced


def test_drafting_resumes_as_the_evidence_behind_a_kept_undrafted_plan_fades():
    policy = SpecPolicy(TABLE, None, gamma=2, lag=1, max_kept=8, evidence_half_life=16.0)
    for _ in range(40):
        policy.acceptance.observe(None, verified=2, accepted=0)
    step = StepContext(other_tokens=2, num_sampling=2)
    assert not policy.plan([Candidate("a", 2), Candidate("b", 2)], step).drafted[0]
    waited = 0
    while not policy.plan([Candidate("a", 2), Candidate("b", 2)], step).drafted[0]:
        waited += 1
        assert waited < 200
    assert policy.kept_plans > 0


def test_a_verify_all_plan_is_kept_until_more_requests_or_a_prefill_join():
    """Sure drafts: the priced plan verifies everything and is kept (expecting what it expected
    per request, every kept round priced for the acceptance model); a second candidate or a
    prefill joining is priced at once."""
    policy = SpecPolicy(TABLE, None, gamma=2, lag=1, max_kept=8)
    sure = [logit(0.99), logit(0.99)]
    policy.record("a", sure, verified=2, accepted=2)
    one, step = [Candidate("a", 2)], StepContext(other_tokens=1, num_sampling=1)
    first = policy.plan(one, step)
    assert first.verify_all and policy.kept_plans == 0
    kept = policy.plan(one, step)
    assert kept.verify_all and policy.kept_plans == 1
    assert kept.predicted_accepted == pytest.approx(first.predicted_accepted)
    assert policy.requests["a"].priced is not None and policy.requests["a"].last_drafted == policy.steps
    policy.plan(one, StepContext(other_tokens=1, num_sampling=1, joining_tokens=50))
    assert policy.kept_plans == 1
    policy.plan(one, step)
    policy.plan(one + [Candidate("b", 2)], StepContext(other_tokens=2, num_sampling=2))
    assert policy.kept_plans == 2


def test_a_drafting_step_is_priced_at_what_it_costs_beyond_plain_steps_not_at_the_load():
    """Plain decode steps run 2 ms over their price (load), drafted ones 2 + 1.5 ms over theirs:
    the drafter passes are re-priced 1.5 ms dearer. Load that then slows plain steps alone moves
    nothing until a drafted step is seen; drafting cheaper than the table never prices below it."""
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 4 + [11.0] * 8, draft_ms=[0.0] + [2.0] * 4)
    policy = SpecPolicy(table, None, gamma=2, lag=1)
    plain, drafted = StepPlan([False, False], 0, 4), StepPlan([True, True], 4, 4)
    for _ in range(5):
        policy.observe_step(drafted, requests=2, tokens=6, seconds=(11.0 + 2.0 + 9.0) / 1e3)
    assert table.draft_ms == [0.0] + [2.0] * 4                # no plain steps to compare with yet
    for _ in range(40):
        policy.observe_step(plain, requests=2, tokens=2, seconds=(10.0 + 2.0) / 1e3)
        policy.observe_step(drafted, requests=2, tokens=6, seconds=(11.0 + 2.0 + 2.0 + 1.5) / 1e3)
    assert table.draft_ms[1:] == pytest.approx([3.5] * 4, abs=0.1)
    for _ in range(40):
        policy.observe_step(plain, requests=2, tokens=2, seconds=(10.0 + 6.0) / 1e3)
    assert table.draft_ms[1:] == pytest.approx([3.5] * 4, abs=0.1)
    for _ in range(60):
        policy.observe_step(drafted, requests=2, tokens=6, seconds=(11.0 + 6.0 + 0.5) / 1e3)
    assert table.draft_ms == [0.0] + [2.0] * 4


def test_what_drafting_costs_under_load_is_learned_for_that_load_alone():
    """Drafting steps of 16 requests run 5 ms over plain ones, those of a lone request 0: a plan
    for 16 requests (or 20, the same load) prices drafter passes 5 ms dearer, one for a lone
    request at the table; a load never seen starts from the nearest lighter one."""
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 64, draft_ms=[0.0] + [2.0] * 16)
    policy = SpecPolicy(table, None, gamma=2, lag=1)
    for _ in range(60):
        for requests, extra in ((1, 0.0), (16, 5.0)):
            policy.observe_step(StepPlan([False], 0, 2), requests=requests, tokens=requests, seconds=10.0 / 1e3)
            policy.observe_step(StepPlan([True], 2, 2), requests=requests, tokens=requests + 2,
                                seconds=(10.0 + 2.0 + extra) / 1e3)
    for requests, price in ((20, 7.0), (1, 2.0), (3, 2.0), (64, 7.0)):
        policy.overhead.price_load(requests)
        assert table.draft_ms[1] == pytest.approx(price, abs=0.1)


def test_switched_off_the_learned_overhead_leaves_the_table_and_back_on_restores_it():
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 12, draft_ms=[0.0] + [2.0] * 4)
    policy = SpecPolicy(table, None, gamma=2, lag=1)
    plain, drafted = StepPlan([False], 0, 2), StepPlan([True], 2, 2)
    for _ in range(40):
        policy.observe_step(plain, requests=1, tokens=1, seconds=10.0 / 1e3)
        policy.observe_step(drafted, requests=1, tokens=3, seconds=14.0 / 1e3)
    assert table.draft_ms[1] == pytest.approx(4.0, abs=0.1)
    policy.overhead.set_enabled(False)
    policy.observe_step(drafted, requests=1, tokens=3, seconds=30.0 / 1e3)
    assert table.draft_ms[1] == 2.0
    policy.overhead.set_enabled(True)
    assert table.draft_ms[1] == pytest.approx(4.0, abs=0.1)
