"""`dspark bench --mode sweep`: output tokens/s by concurrency for plain decoding, DSpark
verify-all and DSpark as it runs by default (confidence-scheduled, its cost model measured once
and cached), in one run (interleaved, medians), plus a PNG.

Concurrency c means at most c requests in flight in the offline engine, each with the same
prompt length and a fixed output length (greedy, ignore_eos): a level runs max(c,
--sweep-requests) requests and admits the next one as soon as one finishes, as a client holding
c connections does (vLLM's `--max-concurrency`). So concurrency 1 decodes several prompts one
after another, chat and code alike, rather than a single prompt's luck with the drafter.
Verify-all and the default run on one engine (switched with `Engine.verifying_all`): two
engines built alike differ by several percent on a CPU, which would otherwise land on their
ratio.
Prompts are held-out (or built-in) chat and code prompts cut or filled to the prompt length from
the front, so each still ends where its answer starts and acceptance stays realistic.
"""

from __future__ import annotations

import contextlib
import copy
import json
import statistics

from dspark.bench.closed_loop import closed_loop
from dspark.outputs import SpecStats

SYSTEMS = ("plain", "verify-all", "default")


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


def round_order(index: int) -> tuple[str, ...]:
    """Round `index`'s order of the systems: a rotation of them, then its reverse, then the next
    rotation, so that no system always runs right after the heaviest one (verify-all at high
    load) or in the same place of a round's drift. Rounds 0 and 1 already put the default and
    plain decoding each once right after verify-all; every 2 x len(SYSTEMS) rounds put each
    system in each place equally often."""
    k = index // 2 % len(SYSTEMS)
    order = SYSTEMS[k:] + SYSTEMS[:k]
    return order[::-1] if index % 2 else order


def _run_arm(engines: dict, name: str, prompts, params, c: int, stats: dict) -> float:
    """One closed loop of one system -> tokens/s; the drafter engine's counters of it go to
    `stats[name]`."""
    engine = engines["plain" if name == "plain" else "spec"].engine
    if name == "plain":
        return closed_loop(engine, prompts, params, c)["tokens_per_s"]
    before = copy.deepcopy(engine.spec_stats)
    with engine.verifying_all() if name == "verify-all" else contextlib.nullcontext():
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
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    medians: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    drafted_share = []              # default: requests' decode steps that drafted, of all of them
    policy = []                     # default: what the policy expected and what was accepted
    bounds = []                     # tok/s of the best plan the cost table allows (see best_plan_gain)
    for c in levels:
        prompts = fixed_length(pool, args.input_tokens, max(c, args.sweep_requests))
        runs: dict[str, list[float]] = {name: [] for name in SYSTEMS}
        for llm in engines.values():
            llm.generate(prompts[:c], warm)
        spec_policy = engines["spec"].engine.policy
        arm_stats = {name: SpecStats() for name in SYSTEMS[1:]}
        kept_before = spec_policy.kept_plans
        for index in range(args.repetitions):
            for name in round_order(index):
                runs[name].append(_run_arm(engines, name, prompts, params, c, arm_stats))
                print(f"concurrency {c}, round {index + 1}/{args.repetitions}, {name}: "
                      f"{runs[name][-1]:.1f} tok/s", flush=True)
        for name in SYSTEMS:
            medians[name].append(statistics.median(runs[name]))
        bounds.append(medians["plain"][-1] * best_plan_gain(spec_policy.table, arm_stats["verify-all"], c))
        stats = arm_stats["default"]
        drafted_share.append(stats.drafted_share)
        policy.append({"predicted_accepted": round(stats.predicted_accepted_tokens, 1),
                       "accepted": stats.accepted_tokens, "verified": stats.verified_tokens,
                       "verified_per_round": round(stats.verified_tokens / max(1, stats.draft_rounds), 2),
                       "kept_plans": spec_policy.kept_plans - kept_before})
    png = plot_sweep(levels, medians, args.png)
    print(f"{args.output_tokens} tokens from each of max(c, {args.sweep_requests}) requests of "
          f"{args.input_tokens} prompt tokens, at most c in flight; medians of {args.repetitions}")
    print("concurrency | plain tok/s | verify-all tok/s | default tok/s | default / best other "
          "| default: request steps that drafted | best plan by the table, tok/s | default / it")
    print("---|---|---|---|---|---|---|---")
    ratios = []
    for i, c in enumerate(levels):
        best = max(medians["plain"][i], medians["verify-all"][i])
        ratios.append(medians["default"][i] / best)
        print(f"{c} | {medians['plain'][i]:.1f} | {medians['verify-all'][i]:.1f} | "
              f"{medians['default'][i]:.1f} | {ratios[-1]:.2f}x | {drafted_share[i]:.0%} | "
              f"{bounds[i]:.1f} | {medians['default'][i] / bounds[i]:.2f}x")
    for c, p in zip(levels, policy):
        print(f"default at {c}: drafts expected accepted {p['predicted_accepted']}, accepted "
              f"{p['accepted']} of {p['verified']} verified ({p['verified_per_round']} a round)")
    print(f"plot: {png}")
    report = {"bench": "sweep", "levels": levels,
              "requests_per_level": [max(c, args.sweep_requests) for c in levels],
              "input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
              "repetitions": args.repetitions,
              "tokens_per_s": {k: [round(x, 2) for x in v] for k, v in medians.items()},
              "default_over_best_other": [round(r, 3) for r in ratios],
              "default_drafted_share": [round(d, 3) for d in drafted_share], "default_policy": policy,
              "best_plan_tokens_per_s": [round(b, 2) for b in bounds],
              "default_over_best_plan": [round(medians["default"][i] / b, 3) for i, b in enumerate(bounds)],
              "plot": png, "runner": {name: llm.engine.load().runner for name, llm in engines.items()}}
    print(json.dumps(report))
    return report
