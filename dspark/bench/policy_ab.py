"""`dspark bench --mode policy`: one of the speculation policy's mechanisms on and off in the
same engine, interleaved with plain decoding, by concurrency (the sweep's closed loop and
prompts). Two engines built alike differ by several percent on a shared CPU (memory placement),
more than a mechanism moves, so the mechanism is switched on the one engine between runs.

Mechanisms: `kept-plans` (plans at either end kept without pricing, against pricing every
step), `draft-overhead` (drafting steps priced at what they cost in the engine, learned
online, against the table's prices alone) and `trial-cap` (at most `MAX_TRIALS` requests
without fresh evidence of their own try drafting in a step, against all of them at once).
"""

from __future__ import annotations

import json
import statistics

from dspark.bench.closed_loop import closed_loop
from dspark.bench.sweep import fixed_length, output_params, prompt_pool
from dspark.outputs import SpecStats
from dspark.spec.policy import MAX_TRIALS

MECHANISMS = ("kept-plans", "draft-overhead", "trial-cap")


def switch(policy, mechanism: str, on: bool, kept: int) -> None:
    if mechanism == "kept-plans":
        policy.keep_plans(kept if on else 0)
    elif mechanism == "trial-cap":
        policy.max_trials = MAX_TRIALS if on else 0
    else:
        policy.overhead.set_enabled(on)


def run_policy_bench(args) -> dict:
    from dspark import LLM
    if args.ablate not in MECHANISMS:
        raise SystemExit(f"bench --mode policy needs --ablate, one of {', '.join(MECHANISMS)}")
    levels = [int(c) for c in str(args.sweep_concurrency).split(",") if c.strip()]
    common = dict(dtype=args.dtype, device=args.device, num_threads=args.threads,
                  max_num_seqs=max(levels), graph=args.graph)
    plain = LLM(args.model, drafter=None, **common)
    spec = LLM(args.model, drafter=args.drafter, cost_table=args.cost_table, min_gain=args.min_gain,
               max_kept_plans=args.max_kept_plans, **common)
    policy = spec.engine.policy
    if policy is None:
        raise SystemExit("bench --mode policy needs the confidence schedule and a drafter")
    pool = prompt_pool(args, plain.tokenizer)
    temperatures = [float(t) for t in str(args.temperatures).split(",") if t.strip()]
    rows = [_level(args, plain, spec, pool, c, t) for c in levels for t in temperatures]
    spread = f" x (1 ± {args.output_spread:g})" if args.output_spread else ""
    print(f"{args.ablate} on and off in one engine; {args.output_tokens}{spread} tokens from max(c, "
          f"{args.sweep_requests}) requests of {args.input_tokens} prompt tokens; medians of {args.repetitions}")
    print("concurrency | temperature | plain tok/s | on tok/s | off tok/s | on / off | on / plain | drafted on / off")
    print("---|---|---|---|---|---|---|---")
    for r in rows:
        t, d = r["tokens_per_s"], r["drafted_share"]
        print(f"{r['concurrency']} | {r['temperature']:g} | {t['plain']} | {t['on']} | {t['off']} | {r['on_over_off']:.3f}x | "
              f"{r['on_over_plain']:.3f}x | {d['on']:.1%} / {d['off']:.1%}")
    report = {"bench": "policy", "mechanism": args.ablate, "repetitions": args.repetitions,
              "input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
              "output_spread": args.output_spread, "levels": rows,
              "draft_overhead_ms": round(policy.overhead.extra_ms, 3)}
    print(json.dumps(report))
    return report


def _level(args, plain, spec, pool, c: int, temperature: float) -> dict:
    """One concurrency at one temperature: plain, mechanism on, mechanism off, interleaved.
    Sampled requests are seeded (one seed for all), so all three write the same text."""
    from dspark import SamplingParams
    policy = spec.engine.policy
    prompts = fixed_length(pool, args.input_tokens, max(c, args.sweep_requests))
    for llm in (plain, spec):
        llm.generate(prompts[:c], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    params = output_params(args.output_tokens, args.output_spread, len(prompts), temperature,
                           seed=None if temperature == 0 else 0)
    runs = {"plain": [], "on": [], "off": []}
    drafted = {"on": [], "off": []}
    for _ in range(args.repetitions):
        runs["plain"].append(closed_loop(plain.engine, prompts, params, c)["tokens_per_s"])
        for state in ("on", "off"):
            switch(policy, args.ablate, state == "on", args.max_kept_plans)
            spec.engine.reset_spec_stats()
            runs[state].append(closed_loop(spec.engine, prompts, params, c)["tokens_per_s"])
            drafted[state].append(spec.engine.spec_stats)
    switch(policy, args.ablate, True, args.max_kept_plans)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"concurrency": c, "temperature": temperature, "tokens_per_s": {k: round(v, 1) for k, v in med.items()},
            "on_over_off": round(med["on"] / med["off"], 3), "on_over_plain": round(med["on"] / med["plain"], 3),
            "drafted_share": {k: round(SpecStats.total(v).drafted_share, 3) for k, v in drafted.items()}}
