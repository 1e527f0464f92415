"""`dspark bench --mode dp`: data-parallel throughput, DP=N ranks (`--dp`, default 2) of T/N
threads against one engine of T threads (`--threads`), at a fixed number of requests in flight (a closed loop: a finished request is
replaced at once), in one run with interleaved repetitions and medians."""

from __future__ import annotations

import json
import statistics
import time

import torch
from tqdm import tqdm

from dspark.bench.closed_loop import closed_loop
from dspark.bench.prompts import bench_prompts


def run_dp_bench(args) -> dict:
    from dspark import SamplingParams
    from dspark.distributed.group import start_group
    from dspark.engine.engine import Engine
    from dspark.llm import build_config
    dp = args.dp if args.dp > 1 else 2
    threads, conc = args.threads or torch.get_num_threads(), args.concurrency_dp
    if threads % dp:
        raise SystemExit(f"--threads {threads} must split evenly over --dp-size {dp}")
    common = dict(model=args.model, dtype=args.dtype, drafter=None if args.no_drafter else args.drafter,
                  max_num_seqs=conc, graph=args.graph)
    systems = {}
    start = time.perf_counter()
    systems[f"dp1 x {threads} threads"] = (Engine(build_config(num_threads=threads, **common)), threads)
    # the group idles while the other system runs: a long timeout keeps its ranks waiting
    group = start_group(build_config(num_threads=threads // dp, data_parallel_size=dp,
                                     dp_timeout_s=3600.0, **common))
    systems[f"dp{dp} x {threads // dp} threads"] = (group, threads // dp)
    print(f"engines ready in {time.perf_counter() - start:.0f} s")
    try:
        return _measure(args, systems, SamplingParams, conc)
    finally:
        group.close()


def _measure(args, systems, sampling_params, conc) -> dict:
    engine = next(iter(systems.values()))[0]
    prompts = [engine.tokenizer.encode(p) for p in bench_prompts(args.num_prompts_dp)]
    params = sampling_params(temperature=0, max_tokens=args.output_tokens_dp, ignore_eos=True)
    for system, threads in systems.values():                 # warm-up
        torch.set_num_threads(threads)
        closed_loop(system, prompts[:conc], sampling_params(temperature=0, max_tokens=4, ignore_eos=True), conc)
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for _ in tqdm(range(args.repetitions), desc="repetitions"):
        for name, (system, threads) in systems.items():       # interleaved: drift hits both alike
            torch.set_num_threads(threads)
            runs[name].append(closed_loop(system, prompts, params, conc))
    base = statistics.median(r["tokens_per_s"] for r in next(iter(runs.values())))
    print(f"system | requests in flight | output tokens/s (median of {args.repetitions}) | vs dp1 | steps")
    print("---|---|---|---|---")
    report = {"bench": "dp", "concurrency": conc, "prompts": len(prompts),
              "output_tokens": args.output_tokens_dp, "results": {}}
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        steps = statistics.median(r["steps"] for r in rs)
        print(f"{name} | {conc} | {tps:.1f} | {tps / base:.2f}x | {steps:.0f}")
        report["results"][name] = {"tokens_per_s": round(tps, 2), "vs_dp1": round(tps / base, 3),
                                   "runs": [round(r["tokens_per_s"], 2) for r in rs]}
    print(json.dumps(report))
    return report


def add_dp_bench_args(p) -> None:
    p.add_argument("--concurrency-dp", type=int, default=16, help="dp: requests in flight")
    p.add_argument("--num-prompts-dp", type=int, default=48, help="dp: requests per repetition")
    p.add_argument("--output-tokens-dp", type=int, default=64, help="dp: tokens per request")
