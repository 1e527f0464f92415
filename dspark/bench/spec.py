"""`dspark bench --mode spec`: plain vs DSpark at batch 1 on held-out prompts, in one run.

Reports, per prompt kind (chat, code): tokens/s of both, the speed-up, the mean accepted length
τ (accepted drafts + 1 per round) and per-position acceptance; greedy outputs are checked equal.
Each prompt runs plain, then DSpark, then the next prompt (interleaved).
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
    from dspark import LLM, SamplingParams
    plain = LLM(args.model, dtype=args.dtype, num_threads=args.threads, drafter=None)
    spec = LLM(args.model, dtype=args.dtype, num_threads=args.threads, drafter=args.drafter)
    if spec.engine.drafter is None:
        raise SystemExit("bench --mode spec compares against a drafter: pass --drafter for this model")
    params = SamplingParams(temperature=0, max_tokens=args.batch1_tokens)
    kinds = args.prompt_source(args.data, plain.tokenizer, args.num_prompts)
    for llm in (plain, spec):
        llm.generate([kinds["code"][0]], SamplingParams(temperature=0, max_tokens=8))      # warm-up
    rows, summary = [], {"bench": "spec", "dtype": args.dtype, "max_tokens": args.batch1_tokens}
    for kind, prompts in kinds.items():
        spec.engine.reset_spec_stats()
        runs = {"plain": [], "dspark": []}
        for _ in range(args.repetitions):
            for name, run in _run({"plain": plain, "dspark": spec}, prompts, params).items():
                runs[name].append(run)
        same = all(a == b for (_, _, x), (_, _, y) in zip(runs["plain"], runs["dspark"]) for a, b in zip(x, y))
        tps = {k: statistics.median(t / s for t, s, _ in v) for k, v in runs.items()}
        stats: SpecStats = spec.engine.spec_stats
        per_pos = [n / stats.draft_rounds for n in stats.accepted_per_position]
        rows.append((kind, len(prompts), f"{tps['plain']:.1f}", f"{tps['dspark']:.1f}",
                     f"{tps['dspark'] / tps['plain']:.2f}x", f"{stats.mean_accepted_length:.2f}",
                     " ".join(f"{p:.2f}" for p in per_pos), "yes" if same else "NO"))
        summary[kind] = {"prompts": len(prompts), "plain_tokens_per_s": round(tps["plain"], 2),
                         "dspark_tokens_per_s": round(tps["dspark"], 2),
                         "speedup": round(tps["dspark"] / tps["plain"], 3),
                         "tau": round(stats.mean_accepted_length, 3),
                         "acceptance_per_position": [round(p, 3) for p in per_pos],
                         "identical_output": same}
    head = ("prompts", "n", "plain tok/s", "DSpark tok/s", "speed-up", "tau", "acceptance by position", "same")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for row in rows:
        print(" | ".join(str(c) for c in row))
    print(json.dumps(summary))
