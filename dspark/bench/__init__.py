"""Benchmark harnesses behind `dspark bench`; each prints a table and ends with one JSON line."""

from __future__ import annotations

import argparse

MODES = ("plain", "spec", "serve", "sweep", "policy", "graphs", "dp", "kernels")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Everything `dspark bench` takes: the engine flags, then each harness's own."""
    from dspark.config_flags import add_engine_flags
    add_engine_flags(p)
    p.add_argument("--mode", choices=MODES, default="plain")
    p.add_argument("--repetitions", type=int, default=3,
                   help="runs to take the median of (serve: requests per client; serve with "
                        "--compare-no-drafter: rounds per server and level)")
    p.add_argument("--batch1-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--data", default=None, help="spec: draft-training data folder (its held-out split), "
                   "a .jsonl of prompts, or `ood` (the shipped out-of-distribution set)")
    p.add_argument("--num-prompts", type=int, default=8, help="spec: prompts per kind")
    p.add_argument("--temperatures", default="0",
                   help="spec, policy: comma-separated sampling temperatures (sampled requests seeded)")
    p.add_argument("--sweep-concurrency", default="1,4,16,64",
                   help="sweep: comma-separated numbers of requests in flight")
    p.add_argument("--sweep-requests", type=int, default=8,
                   help="sweep: requests per level at least (a level of concurrency c runs max(c, this))")
    p.add_argument("--output-spread", type=float, default=0.0,
                   help="sweep: each request's output length drawn from --output-tokens x (1 ± this), "
                        "seeded, so requests finish at different steps as a server's do (0: all alike)")
    p.add_argument("--png", default="bench_sweep.png", help="sweep: where to write the plot")
    from dspark.bench.policy_ab import MECHANISMS
    p.add_argument("--ablate", default=None, choices=MECHANISMS,
                   help="policy: the mechanism switched on and off in one engine")
    p.add_argument("--graph-backends", default="eager,compile",
                   help="graphs: comma-separated backends to compare (eager, compile, cuda)")
    p.add_argument("--graph-levels", default=None,
                   help="graphs: comma-separated concurrencies (default: 1 and --batch), "
                        "e.g. 1,4,16,64 for the GPU sweep with --graph-backends eager,cuda")
    from dspark.bench.serve import add_serve_client_flags
    add_serve_client_flags(p)
    from dspark.bench.dp import add_dp_bench_args
    add_dp_bench_args(p)


def run_bench(args: argparse.Namespace) -> None:
    from dspark.bench.engines import refuse_ignored_engine_flags
    refuse_ignored_engine_flags(args)
    if args.mode == "plain":
        from dspark.bench.plain import run_plain_bench
        run_plain_bench(args)
    elif args.mode == "serve":
        from dspark.bench.serve import run_serve_bench
        run_serve_bench(args)
    elif args.mode == "spec":
        from dspark.bench.spec import run_spec_bench
        run_spec_bench(args)
    elif args.mode == "sweep":
        from dspark.bench.sweep import run_sweep_bench
        run_sweep_bench(args)
    elif args.mode == "policy":
        from dspark.bench.policy_ab import run_policy_bench
        run_policy_bench(args)
    elif args.mode == "graphs":
        from dspark.bench.graphs import run_graphs_bench
        run_graphs_bench(args)
    elif args.mode == "dp":
        from dspark.bench.dp import run_dp_bench
        run_dp_bench(args)
    elif args.mode == "kernels":
        from dspark.bench.kernels import run_kernels_bench
        run_kernels_bench(args)
