"""The `dspark` command line: generate | chat | demo | serve | calibrate | profile |
train-draft | prune-vocab | bench."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import TYPE_CHECKING

from dspark.config_flags import add_engine_flags, engine_config_from_args
from dspark.outputs import SpecStats
from dspark.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dspark.llm import LLM


def format_spec_stats(stats: SpecStats) -> str:
    if stats.draft_rounds == 0:
        return "no speculative rounds (plain decoding)"
    rounds = stats.draft_rounds
    per_pos = " ".join(f"{n / rounds:.2f}" for n in stats.accepted_per_position)
    return (f"rounds {rounds}, drafted {stats.drafted_tokens}, verified {stats.verified_tokens}, "
            f"accepted {stats.accepted_tokens} ({stats.acceptance_rate:.1%} of verified), "
            f"tau {stats.mean_accepted_length:.2f}, per-position acceptance [{per_pos}]"
            + (f", undrafted steps {stats.undrafted_steps}" if stats.undrafted_steps else ""))


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _llm(args: argparse.Namespace) -> "LLM":
    from dspark.llm import LLM
    return LLM.from_config(engine_config_from_args(args))


def _params(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                          stop=args.stop, ignore_eos=args.ignore_eos)


def cmd_generate(args) -> None:
    prompts = args.prompt or [sys.stdin.read()]
    params = _params(args)
    llm = _llm(args)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - start
    for out in outs:
        print(out.prompt + out.text if args.echo else out.text)
        print(f"[{len(out.token_ids)} tokens, finish={out.finish_reason}]", file=sys.stderr)
    total = sum(len(o.token_ids) for o in outs)
    print(f"[{total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s]", file=sys.stderr)
    if args.stats:
        for out in outs:
            print(f"[request {out.request_id}] {format_spec_stats(out.spec)}", file=sys.stderr)
        print(f"[all] {format_spec_stats(llm.engine.spec_stats)}", file=sys.stderr)


def cmd_chat(args) -> None:
    llm = _llm(args)
    params = _params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not line:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        reply = llm.chat(messages, params).text
        messages.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def eval_prompts(data_dir: str | None, tokenizer, limit: int) -> dict[str, list[list[int]]]:
    """The draft-training data's held-out prompts when given, else the built-in ones."""
    if data_dir is None:
        from dspark.bench.heldout import builtin_prompts
        return builtin_prompts(tokenizer, limit)
    from dspark.train.heldout import heldout_prompts
    return heldout_prompts(data_dir, limit)


def cmd_calibrate(args) -> None:
    from dspark.calibrate import run_calibration
    llm = _llm(args)
    kinds = eval_prompts(args.data, llm.tokenizer, args.num_prompts)
    prompts = kinds["chat"] + kinds["code"]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    cal = run_calibration(llm, prompts, params, dataset=args.data or "built-in prompts")
    cal.save(args.out)
    print(f"{cal.num_samples} rounds; wrote {args.out}")
    print("ECE floor: what a perfectly calibrated predictor shows on as many rounds (sampling noise)")
    print("position | T | offset | ECE before | ECE after | floor | held-out quarter: before | after | floor")
    for k, row in enumerate(zip(cal.temperatures, cal.offset_list(), cal.ece_before, cal.ece_after,
                                cal.ece_floor_after, cal.ece_heldout_before, cal.ece_heldout_after,
                                cal.ece_floor_heldout)):
        print(f"{k + 1} | {row[0]:.3f} | {row[1]:+.1f} | " + " | ".join(f"{x:.2%}" for x in row[2:]))


def cmd_demo(args) -> None:
    from dspark.bench.demo import run_demo
    run_demo(args)


def cmd_serve(args) -> None:
    from dspark.server.launch import run_serve
    code = run_serve(args)
    if code:
        sys.exit(code)


def cmd_bench(args) -> None:
    from dspark.bench import run_bench
    args.prompt_source = eval_prompts
    run_bench(args)


def cmd_profile(args) -> None:
    from dspark.worker.profile import ProfileConfig
    llm = _llm(args)
    cfg = ProfileConfig(max_tokens=args.max_tokens, max_requests=args.max_requests,
                        context_len=args.context_len, repeats=args.repeats, warmup=args.warmup,
                        token_stride=args.token_stride)
    table = llm.engine.profile(cfg)
    table.save(args.out)
    print("tokens | verify ms at " + " | ".join(f"{r} requests" for r in table.verify_requests))
    for t in sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, table.max_tokens}):
        if t <= table.max_tokens:
            print(f"{t} | " + " | ".join(f"{row[t]:.2f}" for row in table.verify_ms))
    print("requests | draft ms")
    for r in range(1, table.max_requests + 1):
        print(f"{r} | {table.draft_ms[r]:.2f}")
    print(f"wrote {args.out}")


def cmd_prune_vocab(args) -> None:
    from dspark.train.prune_vocab import run_prune
    if args.drafter in (None, "auto"):
        args.drafter = "embedded"
    run_prune(args)


def cmd_train_draft(args) -> None:
    from dspark.train.cli import run_train
    run_train(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete raw prompts (no chat template)")
    add_engine_flags(p)
    _sampling_args(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: stdin")
    p.add_argument("--echo", action="store_true", help="print the prompt before its completion")
    p.add_argument("--stats", action="store_true", help="print speculative decoding statistics")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with the model (its chat template applied)")
    add_engine_flags(p)
    _sampling_args(p, max_tokens=256)
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("demo", help="plain decoding and DSpark side by side, with speeds")
    add_engine_flags(p)
    p.add_argument("--max-tokens", type=int, default=96)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    from dspark.server.launch import add_serve_args
    add_serve_args(p)                           # the engine flags and the server's
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("calibrate", help="fit STS temperatures for the drafter's confidence head")
    add_engine_flags(p)
    p.add_argument("--data", default=None, help="draft-training data folder: calibrate on its held-out split")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts per kind (chat, code)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", required=True, help="STS calibration JSON to write")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("profile", help="measure the verify/draft cost table for confidence scheduling")
    add_engine_flags(p)
    p.add_argument("--out", required=True, help="cost table JSON to write")
    p.add_argument("--max-tokens", type=int, default=64, help="verify costs for 1..N tokens")
    p.add_argument("--max-requests", type=int, default=8, help="draft costs for 1..R requests, verify costs at powers of two up to R")
    p.add_argument("--context-len", type=int, default=256, help="KV context of every profiled request")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per size (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--token-stride", type=int, default=1,
                   help="time every Nth token count; counts in between cost the next one timed")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("train-draft", help="generate data, train, export and plot a DSpark drafter")
    from dspark.train.cli import add_train_args
    add_train_args(p)
    p.set_defaults(func=cmd_train_draft)

    p = sub.add_parser("prune-vocab", help="give a trained drafter a reduced draft vocabulary")
    add_engine_flags(p)
    p.add_argument("--out", required=True, help="folder for the pruned drafter")
    p.add_argument("--size", type=int, default=8192, help="draft vocabulary size")
    p.add_argument("--num-prompts", type=int, default=256, help="training prompts to count answers of")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="choose from every response token of these "
                   "training data shards (`train-draft --generate-data`) instead of greedy answers")
    p.set_defaults(func=cmd_prune_vocab)

    p = sub.add_parser("bench", help="benchmarks (see dspark/bench)")
    from dspark.bench import add_bench_args
    add_bench_args(p)                           # the engine flags and the benchmarks'
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
