"""The cost table corrected online by measured step times, per kind of step and size class."""

import pytest
import torch
from types import SimpleNamespace

from dspark.engine.spec_schedule import ConfidenceScheduler
from dspark.spec.cost_correction import DRAFTED, PLAIN, CostCorrection, CostScale, size_class
from dspark.spec.planner import CostTable, plan_step


def test_size_classes_are_powers_of_two_and_scale_uses_the_same():
    assert [size_class(t) for t in (1, 2, 3, 4, 5, 8, 9, 16, 17, 512, 513)] == \
        [0, 1, 2, 2, 3, 3, 4, 4, 5, 9, 10]
    corr = CostCorrection(prior_steps=1e-9)
    for c in range(11):                                   # drafted steps: ratio = class + 1
        corr.observe(2 ** c, drafted=True, predicted_ms=10.0, measured_ms=10.0 * (c + 1))
    scale = corr.scale(other_tokens=3, max_budget=600)
    expected = [float(min(size_class(t), 10) + 1) for t in range(3, 604)]
    assert scale.drafted.tolist() == pytest.approx(expected, rel=1e-6)
    assert scale.plain == 1.0


def test_ratios_learn_per_kind_and_class_and_unseen_classes_keep_the_table():
    corr = CostCorrection(decay=0.9)
    assert (corr.ratios == 1.0).all() and corr.ratios.shape == (2, 32)
    for _ in range(60):
        corr.observe(4, drafted=False, predicted_ms=10.0, measured_ms=20.0)   # plain, class 2
        corr.observe(32, drafted=True, predicted_ms=10.0, measured_ms=5.0)    # drafted, class 5
    assert corr.ratios[PLAIN, 2] == pytest.approx(2.0, rel=0.01)
    assert corr.ratios[DRAFTED, 5] == pytest.approx(0.5, rel=0.01)
    assert corr.ratios[DRAFTED, 0] == corr.ratios[DRAFTED, 31] == corr.ratios[DRAFTED, 5]
    assert corr.ratios[PLAIN, 3] == corr.ratios[PLAIN, 2]          # the nearest class seen
    corr.observe(64, drafted=False, predicted_ms=10.0, measured_ms=10.0)    # plain, class 6
    assert corr.ratios[PLAIN, 4] == corr.ratios[PLAIN, 2] and corr.ratios[PLAIN, 5] == corr.ratios[PLAIN, 6]
    assert (CostCorrection().ratios == 1.0).all()                     # nothing seen: the table
    assert corr.steps[PLAIN, 2] == 60 and corr.steps.sum() == 121
    corr.observe(4, drafted=False, predicted_ms=0.0, measured_ms=3.0)          # no prediction: ignored
    assert corr.steps.sum() == 121
    with pytest.raises(ValueError, match="decay"):
        CostCorrection(decay=0.0)


def test_one_stalled_step_moves_its_class_little_and_a_lasting_drift_is_still_learned():
    corr = CostCorrection(decay=0.9)
    for _ in range(30):
        corr.observe(16, drafted=False, predicted_ms=10.0, measured_ms=11.0)
    settled = corr.ratios[PLAIN, 4]
    corr.observe(16, drafted=False, predicted_ms=10.0, measured_ms=76.0)    # one 7.6x step
    assert settled == pytest.approx(1.1, rel=0.01) and corr.ratios[PLAIN, 4] < 1.06 * settled
    for _ in range(40):
        corr.observe(16, drafted=False, predicted_ms=10.0, measured_ms=30.0)   # a real 3x drift
    assert corr.ratios[PLAIN, 4] == pytest.approx(3.0, rel=0.02)


def _rate(s, table, scale, drafted_rows, budget, n, other):
    """Expected tokens per corrected millisecond of one plan, priced slot by slot."""
    flat = sorted(s[drafted_rows].flatten().tolist(), reverse=True)
    draft = table.draft_ms[len(drafted_rows)] if drafted_rows else 0.0
    factor = float(scale.drafted[budget]) if drafted_rows else scale.plain
    return (n + sum(flat[:budget])) / ((draft + table.verify_ms[other + budget]) * factor)


@pytest.mark.parametrize("seed", range(6))
def test_corrected_plan_is_the_brute_force_optimum_of_corrected_costs(seed):
    g = torch.Generator().manual_seed(seed)
    r, gamma = 4, 3
    s = torch.rand(r, gamma, generator=g).cumprod(-1)
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [8.0 + 4.0 * ((t + 7) // 8) for t in range(1, 33)],
                      draft_ms=[0.0] + [1.0 + 0.5 * k for k in range(1, 5)])
    scale = CostScale(plain=float(0.5 + torch.rand(1, generator=g)),
                      drafted=0.5 + torch.rand(r * gamma + 1, generator=g))
    plan = plan_step(s, table, r, r, min_gain=0.0, cost_scale=scale)
    order = sorted(range(r), key=lambda i: -float(s[i].sum()))
    best = max(_rate(s, table, scale, order[:k], b, r, r)
               for k in range(r + 1) for b in range(k * gamma + 1))
    rows = [i for i in range(r) if plan.drafted[i]]
    assert _rate(s, table, scale, rows, plan.budget, r, r) == pytest.approx(best, rel=1e-6)
    ones = CostScale(plain=1.0, drafted=torch.ones(r * gamma + 1))
    assert plan_step(s, table, r, r, 0.0, cost_scale=ones) == plan_step(s, table, r, r, 0.0)


def _request(survivals):
    seq = SimpleNamespace(survival_history=survivals, steps_without_draft=0, probe_backoff=1,
                          generator=None, params=SimpleNamespace(greedy=True))
    return SimpleNamespace(seq=seq, spec=True, sample=True, verify_len=2, num_new_tokens=3)


def test_drafted_steps_slower_than_the_table_says_turn_the_planner_plain():
    """The table prices a drafted step of 4 requests at 1.2x a plain one, and its drafts are
    worth 1.5x the tokens: the planner drafts. Once drafted steps are measured at twice their
    table cost and plain ones at their table cost, it decodes plainly; without correction it
    keeps drafting."""
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 4 + [11.0] * 8, draft_ms=[0.0] + [1.0] * 4)
    sure = [9.0, -9.0]                                     # one draft surely accepted, then none
    for correct in (True, False):
        sched = ConfidenceScheduler(table, None, gamma=2, lag=1, min_gain=0.0, cost_correction=correct)
        for _ in range(50):                                # the population accepts the first draft
            sched.correction.observe(torch.tensor([1.0, 0.0]), verified=2, accepted=1)
        batch = [_request([sched.survival_of(sure)]) for _ in range(4)]
        assert all(sched.plan(batch).drafted)
        for _ in range(30):
            sched.observe_step(tokens=4, draft_requests=0, measured_ms=10.0)
            sched.observe_step(tokens=8, draft_requests=4, measured_ms=24.0)
        assert any(sched.plan(batch).drafted) != correct


def test_a_class_far_off_the_table_warns_once_that_it_is_stale(caplog):
    corr = CostCorrection()
    for _ in range(40):
        corr.observe(8, drafted=False, predicted_ms=10.0, measured_ms=15.0)    # 1.5x: within reason
    assert not corr.stale_warned
    with caplog.at_level("WARNING", logger="dspark.spec.cost_correction"):
        for _ in range(40):
            corr.observe(100, drafted=True, predicted_ms=10.0, measured_ms=30.0)
            corr.observe(3, drafted=False, predicted_ms=10.0, measured_ms=2.0)
    assert corr.stale_warned
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "drafted steps of 65-128 tokens take 2.9" in warnings[0]
    assert "dspark profile" in warnings[0]
