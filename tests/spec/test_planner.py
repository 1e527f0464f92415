"""Budget planner against brute force on synthetic cost tables; top-B allocation and its
non-anticipation."""

import itertools

import pytest
import torch

from dspark.spec.planner import CostTable, _set_prefix_sums, allocate, plan_step


def plan_budget(survival, table, num_sampling, other_tokens, min_gain=0.05) -> int | None:
    """The budget `plan_step` gives when a drafter pass costs what it costs for every request
    (`brute_force`'s price), whatever the draft set: no set then beats drafting every request
    at the same budget, so the best budget is the one to find. None: a plain step."""
    table.draft_ms = [0.0] + [table.draft_ms[survival.shape[0]]] * (len(table.draft_ms) - 1)
    plan = plan_step(survival, table, num_sampling, other_tokens, min_gain)
    return plan.budget if any(plan.drafted) else None

TABLES = {
    "flat": lambda t: 10.0,
    "linear": lambda t: 5.0 + 0.8 * t,
    "staircase": lambda t: 8.0 + 4.0 * ((t + 7) // 8),       # a bucket every 8 tokens
}


def table(kind: str, max_tokens: int = 64, max_requests: int = 8) -> CostTable:
    cost = TABLES[kind]
    return CostTable(fingerprint={"device": "cpu"}, verify_ms=[0.0] + [cost(t) for t in range(1, max_tokens + 1)],
                     draft_ms=[0.0] + [1.0 + 0.2 * r for r in range(1, max_requests + 1)])


def survivals(r: int, gamma: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(r, gamma, generator=g).cumprod(-1)


def brute_force(s: torch.Tensor, t: CostTable, n: int, other: int) -> tuple[int, list[float]]:
    """Every budget b, with expected tokens from the b best slots, priced one by one."""
    flat = sorted(s.flatten().tolist(), reverse=True)
    rates = [(n + sum(flat[:b])) / (t.draft_ms[s.shape[0]] + t.verify_ms[0][other + b])
             for b in range(len(flat) + 1)]
    return max(range(len(rates)), key=lambda b: (rates[b], -b)), rates


@pytest.mark.parametrize("kind,seed", list(itertools.product(TABLES, range(5))))
def test_budget_is_the_brute_force_optimum(kind, seed):
    r, gamma = 4, 7
    s, t = survivals(r, gamma, seed), table(kind)
    best, rates = brute_force(s, t, r, r)
    got = plan_budget(s, t, num_sampling=r, other_tokens=r, min_gain=0.0)
    plain = r / t.verify_ms[0][r]
    if got is None:
        assert plain >= rates[best]
        return
    assert rates[got] == pytest.approx(rates[best], rel=1e-6) and rates[got] > plain
    if kind == "flat":                   # free tokens: verifying everything is optimal
        assert got == r * gamma


def test_min_gain_keeps_verify_all_unless_trimming_pays():
    r, gamma = 4, 7           # one sampling row: drafting beats a plain step by far more than min_gain
    s, t = survivals(r, gamma, 3) ** 0.5, table("linear")
    best, rates = brute_force(s, t, 1, r)
    gain = rates[best] / rates[r * gamma] - 1.0
    assert 0 < gain and best < r * gamma and rates[best] > (1 + 1.1 * gain) / t.verify_ms[0][r]
    assert plan_budget(s, t, 1, r, min_gain=gain * 0.9) == best
    assert plan_budget(s, t, 1, r, min_gain=gain * 1.1) == r * gamma


def test_steps_past_the_table_are_priced_along_its_last_slope_and_fingerprint_mismatch_is_named(tmp_path):
    t = table("linear", max_tokens=40)                     # 5 + 0.8 t
    assert t.verify_costs(38, 44).tolist() == pytest.approx([5 + 0.8 * x for x in range(38, 44)])
    assert t.draft_costs(torch.tensor([0, 8, 10])).tolist() == pytest.approx([0.0, 2.6, 3.0])
    s = torch.ones(8, 7)                                   # certain drafts, cheap tokens: all of them
    assert plan_budget(s, t, 8, 8, min_gain=0.0) == 56
    path = str(tmp_path / "cost.json")
    t.save(path)
    loaded = CostTable.load(path)
    assert loaded == t
    with pytest.raises(ValueError, match="device: table has 'cpu', engine has 'cuda'"):
        loaded.check_fingerprint({"device": "cuda"})


def test_allocation_is_a_prefix_per_request_and_fills_the_budget():
    s = survivals(5, 6, 0)
    for budget in range(0, 31):
        lens = allocate(s, budget)
        assert int(lens.sum()) == budget
        chosen = set(torch.sort(s.flatten(), descending=True, stable=True).indices[:budget].tolist())
        for r in range(5):
            assert chosen & set(range(r * 6, r * 6 + 6)) == set(range(r * 6, r * 6 + int(lens[r])))


def test_saturated_ties_go_to_the_earlier_request_and_position():
    s = torch.ones(3, 4)
    assert allocate(s, 6).tolist() == [4, 2, 0]
    s[1, :] = 0.5
    assert allocate(s, 6).tolist() == [4, 0, 2]


@pytest.mark.parametrize("seed", range(20))
def test_changing_a_draft_never_changes_whether_it_or_earlier_slots_are_verified(seed):
    """Draft x_k only moves the survivals of later slots of its own block (each <= slot k's):
    min(ℓ_r, k+1) must not move, for any budget; saturated survivals included."""
    g = torch.Generator().manual_seed(seed)
    r, gamma = 4, 5
    s = torch.rand(r, gamma, generator=g).clamp(min=0.3).round(decimals=1).cumprod(-1)
    s[seed % r] = 1.0                                           # a saturated block: ties
    row, k = int(torch.randint(r, (1,), generator=g)), int(torch.randint(gamma - 1, (1,), generator=g))
    changed = s.clone()
    factors = torch.rand(gamma - k - 1, generator=g).cumprod(0)
    changed[row, k + 1:] = s[row, k] * factors                  # a different x_k: new c_{k+1..}
    for budget in range(r * gamma + 1):
        a, b = allocate(s, budget), allocate(changed, budget)
        assert min(int(a[row]), k + 1) == min(int(b[row]), k + 1)


def brute_force_plan(s: torch.Tensor, t: CostTable, n: int, other: int, extra=None):
    """Every nested draft set (top-r requests by expected accepted drafts) and every budget
    within it, priced one by one (`extra` [R]: each member's own drafting cost)."""
    r_all, gamma = s.shape
    order = sorted(range(r_all), key=lambda i: -float(s[i].sum()))
    best = (-1.0, None)
    for size in range(r_all + 1):
        flat = sorted(s[order[:size]].flatten().tolist(), reverse=True)
        draft = (t.draft_ms[size] if size else 0.0) + (sum(extra[i] for i in order[:size]) if extra is not None else 0.0)
        for b in range(len(flat) + 1):
            rate = (n + sum(flat[:b])) / (draft + t.verify_ms[0][other + b])
            if rate > best[0] + 1e-12:
                best = (rate, (set(order[:size]), b))
    return best


def rate_of(plan, s, t, n, other, extra=None):
    chosen = [i for i, d in enumerate(plan.drafted) if d]
    flat = sorted(s[chosen].flatten().tolist(), reverse=True)
    draft = (t.draft_ms[len(chosen)] if chosen else 0.0) + (sum(extra[i] for i in chosen) if extra is not None else 0.0)
    return (n + sum(flat[:plan.budget])) / (draft + t.verify_ms[0][other + plan.budget])


@pytest.mark.parametrize("kind,seed", list(itertools.product(TABLES, range(5))))
def test_plan_with_a_draft_set_is_the_brute_force_optimum(kind, seed):
    r, gamma = 5, 4
    s, t = survivals(r, gamma, seed), table(kind)
    t.draft_ms = [0.0] + [3.0 + 2.0 * k for k in range(1, 9)]       # a pricier drafter
    extra = [1.5 * ((seed + i) % 3) for i in range(r)] if seed % 2 else None     # held rows' cost
    best_rate, _ = brute_force_plan(s, t, r, r, extra)
    plan = plan_step(s, t, num_sampling=r, other_tokens=r, min_gain=0.0, draft_extra=extra)
    assert rate_of(plan, s, t, r, r, extra) == pytest.approx(best_rate, rel=1e-6)


def test_a_drafter_that_cannot_pay_is_left_out_and_a_free_one_drafts_everyone():
    s, t = survivals(4, 7, 1) * 0.2, table("flat")
    t.draft_ms = [0.0] + [50.0 * r for r in range(1, 9)]             # 5x a target step, per request
    plan = plan_step(s, t, num_sampling=4, other_tokens=4)
    assert plan.drafted == [False] * 4 and plan.budget == 0 and not plan.verify_all
    t.draft_ms = [0.0] + [1e-6] * 8
    assert plan_step(s, t, num_sampling=4, other_tokens=4).verify_all


def test_the_requests_with_most_expected_drafts_draft_first():
    s = torch.tensor([[0.1, 0.0], [0.9, 0.8], [0.5, 0.2]])
    t = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 16, draft_ms=[0.0, 5.0, 9.0, 30.0])
    plan = plan_step(s, t, num_sampling=3, other_tokens=3, min_gain=0.0)
    # one request: (3 + 1.7) / 15 = 0.313; two: (3 + 2.4) / 19 = 0.284; none: 0.3
    assert plan.drafted == [False, True, False] and plan.budget == 2


def test_drafting_must_beat_a_plain_step_by_min_gain():
    """A request whose draft is predicted to pay 2.7% over a plain step is drafted with min_gain
    0 and left plain with min_gain 0.05; at 5.6% it is drafted either way."""
    t = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 16, draft_ms=[0.0, 10.0, 20.0])
    s = torch.tensor([[0.0, 0.0], [1.0, 0.0]])           # request 1 surely accepts one draft
    # plain: 2 / 10 = 0.2; drafting request 1, one slot: 3 / 20 = 0.15 -> plain wins outright
    assert plan_step(s, t, 2, 2, min_gain=0.0).drafted == [False, False]
    t.draft_ms = [0.0, 0.3, 0.6]          # drafting 1: (2 + 1) / 10.3 = 0.291 vs all: 3 / 10.6
    assert plan_step(s, t, 2, 2, min_gain=0.0).drafted == [False, True]
    t.draft_ms = [0.0, 4.2, 8.4]          # (2 + 1) / 14.2 = 0.211: 5.6% over plain 0.2
    assert plan_step(s, t, 2, 2, min_gain=0.05).drafted == [False, True]
    t.draft_ms = [0.0, 4.6, 9.2]          # (2 + 1) / 14.6 = 0.205: 2.7% over plain
    assert plan_step(s, t, 2, 2, min_gain=0.0).drafted == [False, True]
    assert plan_step(s, t, 2, 2, min_gain=0.05).drafted == [False, False]


@pytest.mark.parametrize("seed", range(4))
def test_set_prefix_sums_equal_sorting_each_sets_slots(seed):
    g = torch.Generator().manual_seed(seed)
    r, gamma = 9, 5
    s = torch.rand(r, gamma, generator=g).cumprod(1)
    s[2] = s[5]                                             # ties across requests
    rank = torch.randperm(r, generator=g)
    sizes = torch.arange(2, r + 1)
    sums = torch.from_numpy(_set_prefix_sums(s.numpy(), rank.numpy(), sizes.numpy())).float()
    assert sums.shape == (len(sizes), r * gamma + 1)
    for c, size in enumerate(sizes.tolist()):
        own = s[rank < size].flatten().sort(descending=True).values
        expected = torch.cat([torch.zeros(1), own.cumsum(0)])
        assert torch.allclose(sums[c, :len(expected)], expected)
        assert torch.allclose(sums[c, len(expected):], expected[-1].expand(r * gamma + 1 - len(expected)))


def test_remembered_costs_are_read_only_and_follow_a_reassigned_list():
    t = CostTable(fingerprint={}, verify_ms=[0.0, 1.0, 2.0, 3.0], draft_ms=[0.0, 1.0, 2.0])
    first = t.verify_costs(1, 3)
    assert t.verify_costs(1, 3) is first and first.tolist() == [1.0, 2.0] and not first.flags.writeable
    t.verify_ms = [[0.0, 5.0, 6.0, 7.0]]                     # a new list: priced anew
    assert t.verify_costs(1, 3).tolist() == [5.0, 6.0]
    drafts = t.draft_costs([0, 2])
    assert drafts.tolist() == [0.0, 2.0] and not drafts.flags.writeable
    assert t.draft_costs([[0, 2]]).shape == (1, 2)            # same values, another shape
    t.draft_ms = [0.0, 4.0, 8.0]
    assert t.draft_costs([0, 2]).tolist() == [0.0, 8.0]


@pytest.mark.parametrize("kind", list(TABLES))
def test_the_bound_that_skips_pricing_draft_sets_never_hides_a_plan_that_pays(kind):
    """The one-pass bound is at least the rate of every draft set and budget that pricing them
    all finds, so where it says no set can beat a plain step (or verify-all) by min_gain, none
    does; over weak to strong survivals both answers occur."""
    import numpy as np
    from dspark.spec.planner import _best_set, _drafting_bound
    t, r, gamma, min_gain = table(kind), 6, 4, 0.05
    skipped = []
    for seed in range(12):
        for strength in (0.01, 0.1, 0.5, 1.0):
            s = (survivals(r, gamma, seed) * strength).numpy().astype(np.float64)
            verify = t.verify_costs(r, r + r * gamma + 1)
            ones, plain = np.ones(r * gamma + 1), r / float(verify[0])
            extra = np.random.default_rng(seed).uniform(0.0, 4.0, r) * (seed % 2)   # held rows' cost
            bound = _drafting_bound(s, extra, t, r, verify)
            skip = bound < (1 + min_gain) * plain
            _, size, _, rate = _best_set(s, extra, t, r, verify, plain, min_gain)
            assert size == 0 or not skip
            assert size == 0 or rate <= bound * (1 + 1e-12)
            skipped.append(skip)
    assert any(skipped) and not all(skipped)


@pytest.mark.parametrize("kind", list(TABLES))
def test_verify_all_decided_by_the_bound_is_what_pricing_every_set_decides(kind):
    """plan_step keeps verify-all without pricing the draft sets when the bound already rules
    out a gain of min_gain over it: the plan is the one the full rule gives (pricing every set,
    then preferring verify-all), step for step, and the shortcut is taken on some of them."""
    import numpy as np
    from dspark.spec.planner import _best_set, _drafting_bound
    t, gamma, min_gain = table(kind), 4, 0.05
    shortcut = 0
    for r in (1, 3, 6):
        for seed in range(8):
            for strength in (0.05, 0.3, 1.0):
                s = (survivals(r, gamma, seed) * strength).numpy().astype(np.float64)
                full = r * gamma
                verify = t.verify_costs(r, r + full + 1)
                ones, plain = np.ones(full + 1), r / float(verify[0])
                full_rate = (r + s.sum()) / (t.draft_costs([r])[0] + verify[full])
                _, size, budget, rate = _best_set(s, np.zeros(r), t, r, verify, plain, min_gain)
                keep_all = not (rate > full_rate and rate >= (1 + min_gain) * full_rate)
                plan = plan_step(s, t, num_sampling=r, other_tokens=r, min_gain=min_gain)
                assert plan.verify_all == keep_all
                assert plan.budget == (full if keep_all else budget)
                shortcut += max(_drafting_bound(s, np.zeros(r), t, r, verify), plain) < (1 + min_gain) * full_rate
    assert shortcut > 0


def test_drafts_on_a_prefill_step_are_priced_on_top_and_judged_against_decoding():
    """A prefill joining the step is paid for either way. Drafts riding in the room its bucket
    leaves cost only the drafter pass, and draft; drafts that each add target time must beat
    the plain decode step's own tokens per millisecond, not the step's with the prefill inside
    (which yields little and would make any draft look cheap)."""
    verify = [0.0] + [10.0] * 8 + [16.0] * 8 + [40.0] * 48 + [40.0 + t for t in range(1, 65)]
    t = CostTable(fingerprint={}, verify_ms=verify, draft_ms=[0.0] + [1.0] * 4)
    s = torch.tensor([[0.3, 0.09]] * 4)                  # 4 decoding requests, γ = 2
    alone = plan_step(s, t, num_sampling=4, other_tokens=4)
    assert all(alone.drafted) and alone.budget == 4      # the 8-token bucket has room for 4
    roomy = plan_step(s, t, num_sampling=4, other_tokens=4, joining_tokens=40)
    assert roomy.verify_all                              # 44 + 8 tokens still cost 40 ms
    linear = plan_step(s, t, num_sampling=4, other_tokens=4, joining_tokens=60)
    assert not any(linear.drafted) and linear.budget == 0
    # priced with the prefill inside the step's own rate, the same drafts would look worth it
    assert plan_step(s, t, num_sampling=4, other_tokens=64).verify_all


def test_drafts_priced_at_nothing_are_still_verified_where_the_bucket_holds_them_for_free():
    """One request, a first draft worth 0.9 and three priced at 0, verification flat up to 8
    tokens: every budget from 1 to 4 reaches the same rate, and the plan takes the largest (a
    price of 0 is an estimate; verifying the draft costs nothing here)."""
    t = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 8 + [20.0] * 8, draft_ms=[0.0, 1.0])
    s = torch.tensor([[0.9, 0.0, 0.0, 0.0]])
    plan = plan_step(s, t, num_sampling=1, other_tokens=1, min_gain=0.0, prefer_verify_all=False)
    assert plan.drafted == [True] and plan.budget == 4


def test_verify_costs_follow_the_steps_request_count():
    """Rows per request count, linear between them, the nearest outside; a format-1 table
    (one row for every count) is refused on load, so a cached one is measured again."""
    t = CostTable(fingerprint={}, verify_ms=[[0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 7.0, 7.0, 10.0, 13.0]],
                  verify_requests=[1, 4], draft_ms=[0.0, 1.0])
    assert t.verify_costs(1, 5).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert t.verify_costs(1, 5, requests=4).tolist() == [7.0, 7.0, 10.0, 13.0]
    assert t.verify_costs(2, 3, requests=2)[0] == pytest.approx(2.0 + (7.0 - 2.0) / 3)
    assert t.verify_costs(4, 5, requests=9).tolist() == [13.0]
    with pytest.raises(ValueError, match="one verify row per request count"):
        CostTable(fingerprint={}, verify_ms=[[0.0, 1.0]], verify_requests=[1, 2], draft_ms=[0.0, 1.0])
    with pytest.raises(ValueError, match="ascend"):
        CostTable(fingerprint={}, verify_ms=[[0.0, 1.0], [0.0, 2.0]], verify_requests=[4, 2],
                  draft_ms=[0.0, 1.0])


def test_a_draft_cheap_for_one_request_is_dear_in_a_step_of_many():
    """The same survivals and drafter cost: one decoding request's drafts fit its bucket, but in
    a step of four requests the table's row for four puts the drafts past a bucket."""
    one = [0.0] + [10.0] * 8 + [20.0] * 8
    four = [0.0] + [10.0] * 4 + [20.0] * 12
    t = CostTable(fingerprint={}, verify_ms=[one, four], verify_requests=[1, 4], draft_ms=[0.0] + [1.0] * 4)
    s = torch.tensor([[0.5, 0.3, 0.1]]).repeat(4, 1)
    assert plan_step(s[:1], t, num_sampling=1, other_tokens=1).budget == 3
    assert not any(plan_step(s, t, num_sampling=4, other_tokens=4).drafted)
