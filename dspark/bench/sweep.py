"""`dspark bench --mode sweep`: output tokens/s by concurrency for plain decoding, DSpark
verify-all and DSpark as it runs by default (confidence-scheduled, its cost model measured once
and cached), and at 2 to 16 requests two fixed plans, in one run (interleaved, medians), plus a
PNG.

Concurrency c means at most c requests in flight in the offline engine, each with the same
prompt length and an output length of --output-tokens, or drawn around it with --output-spread
(greedy, ignore_eos): a level runs max(c, --sweep-requests) requests and admits the next one as
soon as one finishes, as a client holding c connections does (vLLM's `--max-concurrency`). So
concurrency 1 decodes several prompts one after another, chat and code alike, rather than a
single prompt's luck with the drafter. Verify-all, the fixed plans and the default run on one
engine (`Engine.planning_with`): two engines built alike differ by several percent on a CPU,
which would otherwise land on their ratio.
Prompts are held-out (or built-in) chat and code prompts cut or filled to the prompt length from
the front, so each still ends where its answer starts and acceptance stays realistic.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import statistics

from dspark.bench.closed_loop import closed_loop
from dspark.outputs import SpecStats
from dspark.spec.planner import StepPlan

SYSTEMS = ("plain", "verify-all", "default")
# Fixed plans (every request drafts, k drafts a request verified) run where neither plain
# decoding nor verify-all is clearly best.
FIXED_DRAFTS = (1, 2)
FIXED_LEVELS = range(2, 17)


class FixedPlan:
    """A policy of one plan: every request drafts and the step verifies k drafts per request,
    the best slots by current survival (`planner.allocate`). It learns nothing; the sweep
    measures it against the default, whose table may price such plans wrong."""

    def __init__(self, drafts: int):
        self.drafts = drafts

    def plan(self, candidates, step) -> StepPlan:
        n = len(candidates)
        budget = sum(min(self.drafts, c.verify_cap) for c in candidates)
        return StepPlan(drafted=[True] * n, budget=budget, full=sum(c.verify_cap for c in candidates))

    def record(self, request_id, confidence_logits, verified, accepted) -> None:
        pass

    def observe_step(self, plan, requests, tokens, seconds) -> None:
        pass

    def forget(self, request_id) -> None:
        pass


def systems_at(c: int) -> tuple[str, ...]:
    """The systems a level of c requests runs, in their base order."""
    return SYSTEMS + tuple(f"fixed-{k}" for k in FIXED_DRAFTS if c in FIXED_LEVELS)


def fixed_length(prompts: list[list[int]], length: int, n: int) -> list[list[int]]:
    """n prompts of exactly `length` tokens: the last `length` tokens of each prompt, prefixed
    with the tail of the previous prompts where a prompt is shorter."""
    out = []
    for i in range(n):
        ids = list(prompts[i % len(prompts)])
        j = i
        while len(ids) < length:
            j += 1
            ids = list(prompts[j % len(prompts)]) + ids
        out.append(ids[-length:])
    return out


def prompt_pool(args, tokenizer) -> list[list[int]]:
    """Chat and code prompts alternating, so every level mixes both kinds."""
    kinds = args.prompt_source(args.data, tokenizer, 64)
    return [p for pair in zip(kinds["chat"], kinds["code"]) for p in pair]


def best_plan_gain(table, acceptance, requests: int) -> float:
    """What the best plan the cost table allows gains over plain decoding, in tokens per ms, for
    `requests` decoding requests whose drafts survive as the verify-all engine measured in the
    same run (its share of rounds accepting each position): every draft set and budget priced,
    no hysteresis. Multiplied by plain decoding's measured tok/s, the sweep's bound."""
    import numpy as np
    from dspark.spec.planner import plan_step
    from dspark.spec.policy import expected_accepted
    rounds = max(1, acceptance.draft_rounds)
    survival = np.tile(np.asarray(acceptance.accepted_per_position, dtype=np.float64) / rounds, (requests, 1))
    plan = plan_step(survival, table, requests, requests, min_gain=0.0, prefer_verify_all=False)
    tokens = requests + expected_accepted(survival, plan)
    tokens_after = requests + plan.budget
    cost = table.draft_costs([sum(plan.drafted)])[0] + table.verify_costs(tokens_after, tokens_after + 1,
                                                                          requests)[0]
    plain = requests / table.verify_costs(requests, requests + 1, requests)[0]
    return float(tokens / cost / plain)


def _engines(args, max_seqs: int) -> dict:
    from dspark import LLM
    common = dict(dtype=args.dtype, device=args.device, num_threads=args.threads, max_num_seqs=max_seqs,
                  graph=args.graph)
    plain = LLM(args.model, drafter=None, **common)
    spec = LLM(args.model, drafter=args.drafter, cost_table=args.cost_table, min_gain=args.min_gain,
               max_kept_plans=args.max_kept_plans, **common)
    if spec.engine.policy is None:
        raise SystemExit("bench --mode sweep compares against a drafter: pass --drafter for this model")
    return {"plain": plain, "spec": spec}


def round_order(index: int, systems: tuple[str, ...] = SYSTEMS) -> tuple[str, ...]:
    """Round `index`'s order of the systems: a rotation of them, then its reverse, then the next
    rotation, so that no system always runs right after the heaviest one (verify-all at high
    load) or in the same place of a round's drift. Rounds 0 and 1 already put the default and
    plain decoding each once right after verify-all; every 2 x len(SYSTEMS) rounds put each
    system in each place equally often."""
    k = index // 2 % len(systems)
    order = systems[k:] + systems[:k]
    return order[::-1] if index % 2 else order


def _run_arm(engines: dict, name: str, prompts, params, c: int, stats: dict) -> float:
    """One closed loop of one system -> tokens/s; the drafter engine's counters of it go to
    `stats[name]`."""
    engine = engines["plain" if name == "plain" else "spec"].engine
    if name == "plain":
        return closed_loop(engine, prompts, params, c)["tokens_per_s"]
    before = copy.deepcopy(engine.spec_stats)
    other = FixedPlan(int(name.removeprefix("fixed-"))) if name.startswith("fixed-") else None
    with engine.planning_with(other) if name != "default" else contextlib.nullcontext():
        tokens_per_s = closed_loop(engine, prompts, params, c)["tokens_per_s"]
    stats[name] = SpecStats.total([stats[name], engine.spec_stats.since(before)])
    return tokens_per_s


def plot_sweep(levels: list[int], medians: dict[str, list[float]], path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in SYSTEMS:
        ax.plot(levels, medians[name], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title("plain vs DSpark verify-all vs DSpark default (confidence-scheduled)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_sweep_bench(args) -> dict:
    from dspark import SamplingParams
    levels = [int(c) for c in str(args.sweep_concurrency).split(",") if c.strip()]
    engines = _engines(args, max(levels))
    pool = prompt_pool(args, engines["plain"].tokenizer)
    if not 0.0 <= args.output_spread < 1.0:
        raise SystemExit(f"--output-spread must be in [0, 1), got {args.output_spread}")
    rows = [_level(args, engines, pool, c) for c in levels]
    png = plot_sweep(levels, {name: [r["medians"][name] for r in rows] for name in SYSTEMS}, args.png)
    report = _report(args, levels, rows, png, engines)
    print(json.dumps(report))
    return report


def output_params(tokens: int, spread: float, n: int, temperature: float = 0.0, seed: int | None = None) -> list:
    """n requests' parameters, their lengths uniform in tokens x (1 ± spread), seeded:
    requests of one length that start together stay in step under plain decoding and join
    their successors' prefill at once, which no server's requests do (docs/speculation.md,
    "Fixed plans beside the default")."""
    from dspark import SamplingParams
    rng = random.Random(0)
    low, high = max(1, round(tokens * (1 - spread))), max(1, round(tokens * (1 + spread)))
    return [SamplingParams(temperature=temperature, max_tokens=rng.randint(low, high), ignore_eos=True, seed=seed)
            for _ in range(n)]


def _level(args, engines: dict, pool, c: int) -> dict:
    """One concurrency: every system's runs interleaved -> medians, the default's counters and
    the table's best-plan bound."""
    from dspark import SamplingParams
    prompts = fixed_length(pool, args.input_tokens, max(c, args.sweep_requests))
    params = output_params(args.output_tokens, args.output_spread, len(prompts))
    systems = systems_at(c)
    runs: dict[str, list[float]] = {name: [] for name in systems}
    for llm in engines.values():
        llm.generate(prompts[:c], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    spec_policy = engines["spec"].engine.policy
    arm_stats = {name: SpecStats() for name in systems[1:]}
    kept_before = spec_policy.kept_plans
    for index in range(args.repetitions):
        for name in round_order(index, systems):
            runs[name].append(_run_arm(engines, name, prompts, params, c, arm_stats))
            print(f"concurrency {c}, round {index + 1}/{args.repetitions}, {name}: "
                  f"{runs[name][-1]:.1f} tok/s", flush=True)
    medians = {name: statistics.median(r) for name, r in runs.items()}
    stats = arm_stats["default"]
    return {"medians": medians, "drafted_share": stats.drafted_share,
            "bound": medians["plain"] * best_plan_gain(spec_policy.table, arm_stats["verify-all"], c),
            "policy": {"predicted_accepted": round(stats.predicted_accepted_tokens, 1),
                       "accepted": stats.accepted_tokens, "verified": stats.verified_tokens,
                       "verified_per_round": round(stats.verified_tokens / max(1, stats.draft_rounds), 2),
                       "kept_plans": spec_policy.kept_plans - kept_before}}


def _report(args, levels: list[int], rows: list[dict], png: str, engines: dict) -> dict:
    """The table (printed) and the JSON report. "Best measured" is the fastest system run at
    the level, fixed plans included: a plan the table prices above plain decoding may not be."""
    spread = f" x (1 ± {args.output_spread:g})" if args.output_spread else ""
    print(f"{args.output_tokens}{spread} tokens from each of max(c, {args.sweep_requests}) requests of "
          f"{args.input_tokens} prompt tokens, at most c in flight; medians of {args.repetitions}")
    print("concurrency | plain tok/s | verify-all tok/s | default tok/s | default / best other "
          "| default: request steps that drafted | best plan by the table, tok/s | default / it "
          "| best fixed plan, tok/s | default / best measured")
    print("---|---|---|---|---|---|---|---|---|---")
    default = [r["medians"]["default"] for r in rows]
    other = [d / max(r["medians"]["plain"], r["medians"]["verify-all"]) for d, r in zip(default, rows)]
    measured = [d / max(v for k, v in r["medians"].items() if k != "default") for d, r in zip(default, rows)]
    fixed = {f"fixed-{k}": [r["medians"].get(f"fixed-{k}") for r in rows] for k in FIXED_DRAFTS}
    for i, (c, r) in enumerate(zip(levels, rows)):
        best_fixed = max(((v[i], name) for name, v in fixed.items() if v[i] is not None), default=None)
        m = r["medians"]
        print(f"{c} | {m['plain']:.1f} | {m['verify-all']:.1f} | {m['default']:.1f} | {other[i]:.2f}x | "
              f"{r['drafted_share']:.0%} | {r['bound']:.1f} | {m['default'] / r['bound']:.2f}x | "
              f"{f'{best_fixed[0]:.1f} ({best_fixed[1]})' if best_fixed else '-'} | {measured[i]:.2f}x")
    for c, r in zip(levels, rows):
        p = r["policy"]
        print(f"default at {c}: drafts expected accepted {p['predicted_accepted']}, accepted "
              f"{p['accepted']} of {p['verified']} verified ({p['verified_per_round']} a round)")
    print(f"plot: {png}")
    return {"bench": "sweep", "levels": levels,
            "requests_per_level": [max(c, args.sweep_requests) for c in levels],
            "input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
            "output_spread": args.output_spread, "repetitions": args.repetitions,
            "tokens_per_s": {k: [round(r["medians"][k], 2) for r in rows] for k in SYSTEMS},
            "fixed_plans_tokens_per_s": {k: [None if x is None else round(x, 2) for x in v] for k, v in fixed.items()},
            "default_over_best_other": [round(x, 3) for x in other],
            "default_over_best_measured": [round(x, 3) for x in measured],
            "default_drafted_share": [round(r["drafted_share"], 3) for r in rows],
            "default_policy": [r["policy"] for r in rows],
            "best_plan_tokens_per_s": [round(r["bound"], 2) for r in rows],
            "default_over_best_plan": [round(r["medians"]["default"] / r["bound"], 3) for r in rows],
            "plot": png, "runner": {name: llm.engine.load().runner for name, llm in engines.items()}}
