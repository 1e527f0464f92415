"""`dspark bench --mode spec`: plain vs DSpark at batch 1 on held-out prompts, in one run.

Reports, per sampling temperature (`--temperatures`, default greedy only) and prompt kind (chat,
code): tokens/s of both, the speed-up, the mean accepted length τ (accepted drafts + 1 per
round), per-position acceptance and the time of a DSpark round (its share of the prompt's
prefill included), against a greedy round of the same prompts where the run has temperature 0;
outputs are checked equal at every temperature: sampled
requests are seeded per prompt, alike for both systems, and a seeded request's text depends on
its seed alone (spec/verify.py). Each prompt runs plain, then DSpark, then the next prompt
(interleaved).
"""

from __future__ import annotations

import json
import statistics
import time

from dspark.outputs import SpecStats


def _run(engines: dict, prompts, params) -> dict[str, tuple[int, float, list]]:
    """Each prompt through every engine in turn, so the machine's drift over a run (other
    tenants, the read bandwidth) falls on both systems alike -> {name: (tokens, seconds, outputs)}."""
    runs = {name: (0, 0.0, []) for name in engines}
    for ids in prompts:
        for name, llm in engines.items():
            start = time.perf_counter()
            out = llm.generate([ids], params, use_tqdm=False)[0]
            tokens, seconds, outs = runs[name]
            runs[name] = (tokens + len(out.token_ids), seconds + time.perf_counter() - start, outs + [out.token_ids])
    return runs


def run_spec_bench(args) -> None:
    from dspark import SamplingParams
    from dspark.bench.engines import plain_and_spec
    plain, spec = plain_and_spec(args)
    if spec is None:
        raise SystemExit("bench --mode spec compares against a drafter: pass --drafter for this model")
    from dspark.bench.prompts import file_prompts
    kinds = (file_prompts(args.data, plain.tokenizer, args.num_prompts)
             or args.prompt_source(args.data, plain.tokenizer, args.num_prompts))
    for llm in (plain, spec):
        llm.generate([kinds["code"][0]], SamplingParams(temperature=0, max_tokens=8))      # warm-up
    temperatures = [float(t) for t in str(args.temperatures).split(",") if t.strip()]
    rows, summary = [], {"bench": "spec", "dtype": args.dtype, "max_tokens": args.batch1_tokens,
                         "spec_schedule": args.spec_schedule}
    greedy_ms: dict[str, float] = {}
    for temperature in temperatures:
        for kind, prompts in kinds.items():
            row, result = _measure(plain, spec, prompts, temperature, args)
            if temperature == 0:
                greedy_ms[kind] = result["ms_per_round"]
            vs = result["ms_per_round"] / greedy_ms[kind] if kind in greedy_ms else None
            result["round_vs_greedy"] = None if vs is None else round(vs, 3)
            rows.append((f"{temperature:g}", kind, len(prompts)) + row + ("-" if vs is None else f"{vs:.2f}x",))
            summary[kind if temperatures == [0.0] else f"{kind}@{temperature:g}"] = result
    head = ("temperature", "prompts", "n", "plain tok/s", "DSpark tok/s", "speed-up", "tau",
            "acceptance by position", "same", "ms / round", "round / greedy round")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for row in rows:
        print(" | ".join(str(c) for c in row))
    summary["runner"] = {"plain": plain.engine.load().runner, "dspark": spec.engine.load().runner}
    print(json.dumps(summary))


def _measure(plain, spec, prompts, temperature: float, args) -> tuple[tuple, dict]:
    """One kind at one temperature: (table cells, JSON entry)."""
    from dspark import SamplingParams
    spec.engine.reset_spec_stats()
    runs: dict[str, list[tuple[int, float, list]]] = {"plain": [], "dspark": []}   # per repetition
    for rep in range(args.repetitions):
        totals = {name: (0, 0.0, []) for name in runs}
        for i, ids in enumerate(prompts):
            params = SamplingParams(temperature=temperature, max_tokens=args.batch1_tokens,
                                    seed=None if temperature == 0 else 1000 * rep + i)
            for name, (t, sec, outs) in _run({"plain": plain, "dspark": spec}, [ids], params).items():
                done = totals[name]
                totals[name] = (done[0] + t, done[1] + sec, done[2] + outs)
        for name, total in totals.items():
            runs[name].append(total)
    same = all(x == y for (_, _, x), (_, _, y) in zip(runs["plain"], runs["dspark"]))
    tps = {k: statistics.median(t / s for t, s, _ in v) for k, v in runs.items()}
    stats: SpecStats = spec.engine.spec_stats
    per_pos = [n / max(1, stats.draft_rounds) for n in stats.accepted_per_position]
    cells = (f"{tps['plain']:.1f}", f"{tps['dspark']:.1f}", f"{tps['dspark'] / tps['plain']:.2f}x",
             f"{stats.mean_accepted_length:.2f}", " ".join(f"{p:.2f}" for p in per_pos),
             "yes" if same else "NO", f"{_ms_per_round(runs['dspark'], stats):.2f}")
    return cells, {"prompts": len(prompts), "temperature": temperature,
                   "plain_tokens_per_s": round(tps["plain"], 2), "dspark_tokens_per_s": round(tps["dspark"], 2),
                   "speedup": round(tps["dspark"] / tps["plain"], 3), "tau": round(stats.mean_accepted_length, 3),
                   "acceptance_per_position": [round(p, 3) for p in per_pos], "identical_output": same,
                   "ms_per_round": round(_ms_per_round(runs["dspark"], stats), 3)}


def _ms_per_round(runs: list[tuple[int, float, list]], stats: SpecStats) -> float:
    """DSpark's time over every repetition divided by the rounds it drafted."""
    return 1e3 * sum(seconds for _, seconds, _ in runs) / max(1, stats.draft_rounds)
