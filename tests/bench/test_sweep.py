"""The sweep harness on a tiny pair: fixed-length prompts, all three systems, table, PNG, JSON."""

import json
import types

from dspark import LLM, SamplingParams
from dspark.bench.closed_loop import closed_loop
from dspark.bench.sweep import (SYSTEMS, FixedPlan, best_plan_gain, fixed_length, output_params, round_order,
                                run_sweep_bench)
from dspark.outputs import SpecStats
from dspark.spec.planner import CostTable
from tiny import save_random_drafter, save_tiny


def test_fixed_length_keeps_each_prompt_tail():
    pool = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    out = fixed_length(pool, 4, 4)
    assert all(len(p) == 4 for p in out)
    assert out[0] == [5, 1, 2, 3] and out[2] == [7, 8, 9, 10] and out[3][-3:] == [1, 2, 3]


def test_rounds_rotate_so_each_system_takes_each_place():
    """Every 2 x len(SYSTEMS) rounds each system runs equally often in every place and right
    after every other system; the first two rounds already put both the default and plain
    decoding right after verify-all (the sweep's order had always run the default after it)."""
    rounds = [round_order(i) for i in range(2 * len(SYSTEMS))]
    assert all(sorted(r) == sorted(SYSTEMS) for r in rounds)
    for place in range(len(SYSTEMS)):
        assert sorted(r[place] for r in rounds) == sorted(SYSTEMS * 2)
    follows = [(r[i - 1], r[i]) for r in rounds for i in range(1, len(r))]
    assert {pair: follows.count(pair) for pair in follows} == \
        {(a, b): 2 for a in SYSTEMS for b in SYSTEMS if a != b}
    first_two = [(r[i - 1], r[i]) for r in rounds[:2] for i in range(1, len(r))]
    assert ("verify-all", "default") in first_two and ("verify-all", "plain") in first_two


def test_sweep_reports_every_system_at_every_level(tmp_path, capsys):
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=3)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, copy_prev=6.0, seed=1)
    args = types.SimpleNamespace(
        model=str(tmp_path / "t"), drafter=str(tmp_path / "d"), dtype="float32", threads=None,
        sweep_concurrency="1,3", sweep_requests=4, repetitions=1, input_tokens=6, output_tokens=5, data=None,
        cost_table=None, min_gain=0.05, max_kept_plans=16, output_spread=0.5, png=str(tmp_path / "sweep.png"), graph="eager", device="cpu",
        prompt_source=lambda data, tok, n: {"chat": [[3, 4, 5]], "code": [[7, 8, 9, 10]]})
    report = run_sweep_bench(args)
    assert report["levels"] == [1, 3] and report["requests_per_level"] == [4, 4]
    assert report["output_spread"] == 0.5
    assert set(report["tokens_per_s"]) == set(SYSTEMS)
    assert all(len(v) == 2 and min(v) > 0 for v in report["tokens_per_s"].values())
    assert (tmp_path / "sweep.png").stat().st_size > 5000
    assert all(b > 0 for b in report["best_plan_tokens_per_s"])
    fixed = report["fixed_plans_tokens_per_s"]          # measured where 1 < c <= 16 only
    assert set(fixed) == {"fixed-1", "fixed-2"} and all(v[0] is None and v[1] > 0 for v in fixed.values())
    for i in range(2):          # the best measured system includes plain and verify-all
        assert report["default_over_best_measured"][i] <= report["default_over_best_other"][i]
    assert report["default_over_best_measured"][1] < report["default_over_best_other"][1] or \
        max(v[1] for v in fixed.values()) <= max(report["tokens_per_s"][s][1] for s in ("plain", "verify-all"))
    assert set(report["runner"]) == {"plain", "spec"}     # verify-all and the default share an engine
    assert all(counters["target_graph_steps"] > 0 for counters in report["runner"].values())
    for level in report["default_policy"]:
        assert level["accepted"] <= level["verified"] and level["predicted_accepted"] >= 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == report


def test_verifying_all_verifies_every_draft_and_gives_the_policy_back(tmp_path):
    """The sweep's verify-all arm on the default engine: every request drafts every step, the
    policy neither plans nor learns; it plans again afterwards."""
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=3)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, copy_prev=6.0, seed=1)
    llm = LLM(str(tmp_path / "t"), drafter=str(tmp_path / "d"), dtype="float32", graph="eager")
    policy, engine = llm.engine.policy, llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with engine.planning_with(None):
        assert engine.policy is None and engine.scheduler.policy is None
        llm.generate([[3, 4, 5], [7, 8, 9]], params, use_tqdm=False)
    stats = engine.spec_stats
    assert stats.draft_rounds > 0 and stats.undrafted_steps == 0 and stats.predicted_accepted_tokens == 0
    assert policy.steps == 0 and not policy.requests
    assert engine.policy is policy and engine.scheduler.policy is policy
    llm.generate([[3, 4, 5]], params, use_tqdm=False)
    assert policy.steps > 0


def test_a_fixed_plan_verifies_k_drafts_a_request_and_stays_exact(tmp_path):
    """The sweep's fixed plans: every request drafts each step and the step verifies k drafts a
    request in all (the best slots), learning nothing; greedy output is plain decoding's."""
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=3)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, copy_prev=6.0, seed=1)
    llm = LLM(str(tmp_path / "t"), drafter=str(tmp_path / "d"), dtype="float32", graph="eager")
    plain = LLM(str(tmp_path / "t"), drafter=None, dtype="float32", graph="eager")
    engine, prompts = llm.engine, [[3, 4, 5], [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with engine.planning_with(FixedPlan(1)):
        outs = llm.generate(prompts, params, use_tqdm=False)
    stats = engine.spec_stats
    assert stats.draft_rounds > 0 and stats.undrafted_steps == 0
    assert 0 < stats.verified_tokens <= stats.draft_rounds       # one draft a request-round in all
    assert engine.policy.steps == 0
    expected = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


def test_output_lengths_spread_around_the_output_tokens_the_same_every_time(tmp_path):
    """Lengths in tokens x (1 ± spread), the same for every system (seeded), all alike at 0;
    the closed loop gives each prompt its own parameters."""
    lengths = [p.max_tokens for p in output_params(100, 0.5, 64)]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 16
    assert lengths == [p.max_tokens for p in output_params(100, 0.5, 64)]
    assert {p.max_tokens for p in output_params(100, 0.0, 8)} == {100}
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=2, seed=3)
    llm = LLM(str(tmp_path / "t"), drafter=None, dtype="float32", max_num_seqs=8, graph="eager")
    done, step = [], llm.engine.step
    llm.engine.step = lambda: [o for o in step() if not o.finished or done.append(len(o.token_ids)) or True]
    params = output_params(6, 0.5, 5)
    closed_loop(llm.engine, [[3, 4, 5 + i] for i in range(5)], params, 2)
    assert sorted(done) == sorted(p.max_tokens for p in params)


def test_a_level_keeps_at_most_c_requests_in_flight_and_runs_them_all(tmp_path):
    """Concurrency c is a cap on requests in flight, as a client with c connections: the next
    request enters when one finishes, and every request runs to its full length."""
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=2, seed=3)
    llm = LLM(str(tmp_path / "t"), drafter=None, dtype="float32", max_num_seqs=8, graph="eager")
    scheduler, step = llm.engine.scheduler, llm.engine.step
    in_flight, finished_lengths = [], []

    def observed_step():
        in_flight.append(len(scheduler.running) + len(scheduler.waiting))
        outs = step()
        finished_lengths.extend(len(o.token_ids) for o in outs if o.finished)
        return outs
    llm.engine.step = observed_step
    prompts = [[3, 4, 5 + i] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert closed_loop(llm.engine, prompts, params, 2)["tokens_per_s"] > 0
    assert max(in_flight) == 2 and finished_lengths == [6] * 5
    assert not llm.engine.has_unfinished


def test_the_best_plan_bound_prices_every_plan_on_the_table():
    """Verification free up to 8 tokens, a cheap drafter: with every first draft accepted and no
    second one, one request gains (1 + 1) / (10 + 1) over 1 / 10; where drafts are never
    accepted, or drafting costs a whole step, nothing beats plain decoding (gain 1)."""
    table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * 8 + [30.0] * 8, draft_ms=[0.0] + [1.0] * 4)
    sure_first = SpecStats(draft_rounds=10, accepted_per_position=[10, 0, 0])
    assert best_plan_gain(table, sure_first, 1) == 2 / 11 / (1 / 10)
    assert best_plan_gain(table, SpecStats(draft_rounds=10, accepted_per_position=[0, 0, 0]), 4) == 1.0
    dear = CostTable(fingerprint={}, verify_ms=table.verify_ms, draft_ms=[0.0] + [100.0] * 4)
    assert best_plan_gain(dear, sure_first, 1) == 1.0
