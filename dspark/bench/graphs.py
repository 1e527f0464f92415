"""`dspark bench --mode graphs`: decode tokens/s with each graph backend, plain and DSpark, at
batch 1 and a larger batch, in one run (interleaved repetitions, medians), DSpark against plain
on the same backend, and how close batch-1 plain decoding comes to the memory-bandwidth roofline
(weight bytes per step over measured read bandwidth)."""

from __future__ import annotations

import json
import statistics
import time

from dspark.bench.heldout import builtin_prompts
from dspark.bench.roofline import read_bandwidth, weight_bytes


def _backends(args) -> list[str]:
    import torch
    names = [b.strip() for b in args.graph_backends.split(",") if b.strip()]
    if "cuda" in names and not torch.cuda.is_available():
        raise SystemExit("--graph-backends cuda needs an NVIDIA GPU")
    return names


BATCH1_PROMPTS = 4         # batch 1 decodes this many prompts one after another (chat, code, ...)


def _run(llm, batches, params) -> tuple[float, float]:
    """Each batch of prompts decoded in turn -> (output tokens/s, median TPOT seconds)."""
    seconds, outs = 0.0, []
    for prompts in batches:
        start = time.perf_counter()
        outs += llm.generate(prompts, params)
        seconds += time.perf_counter() - start
    tpots = [o.metrics.tpot(len(o.token_ids)) for o in outs]
    return sum(len(o.token_ids) for o in outs) / seconds, statistics.median(t for t in tpots if t)


def _cases(tokenizer, levels: list[int]) -> dict[int, list[list[list[int]]]]:
    """level -> batches: the first n prompts together, and at batch 1 the first BATCH1_PROMPTS
    alone, so one prompt's acceptance does not decide the batch-1 figure. Chat prompts go
    through the chat template, as the spec benchmark and the server send them."""
    kinds = builtin_prompts(tokenizer, max(max(levels), BATCH1_PROMPTS))
    pool = [p for pair in zip(kinds["chat"], kinds["code"]) for p in pair]
    prompts = [pool[i % len(pool)] for i in range(max(max(levels), BATCH1_PROMPTS))]
    return {n: [[p] for p in prompts[:BATCH1_PROMPTS]] if n == 1 else [prompts[:n]] for n in levels}


def run_graphs_bench(args) -> dict:
    from dspark import LLM, SamplingParams
    levels = sorted({int(c) for c in args.graph_levels.split(",")}) if args.graph_levels else [1, args.batch]
    batch = max(levels)
    common = dict(dtype=args.dtype, num_threads=args.threads, max_num_seqs=max(batch, 1),
                  max_graph_tokens=args.max_graph_tokens, device=args.device)
    engines = {}
    for backend in _backends(args):
        start = time.perf_counter()
        engines[("plain", backend)] = LLM(args.model, drafter=None, graph=backend, **common)
        if args.drafter is not None or args.model is None:
            engines[("dspark", backend)] = LLM(args.model, drafter=args.drafter, graph=backend, **common)
        print(f"{backend}: engines ready in {time.perf_counter() - start:.0f} s (capture included)")
    cases = _cases(next(iter(engines.values())).tokenizer, levels)
    params = SamplingParams(temperature=0, max_tokens=args.batch1_tokens, ignore_eos=True)
    for llm in engines.values():
        for batches in cases.values():
            llm.generate(batches[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    runs: dict[tuple, list[tuple[float, float]]] = {}
    for _ in range(args.repetitions):
        for size, batches in cases.items():
            for key, llm in engines.items():          # interleaved: drift hits every system alike
                runs.setdefault((*key, size), []).append(_run(llm, batches, params))
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in runs.items()}
    return _report(args, engines, med, cases)


def _report(args, engines, med, cases) -> dict:
    bandwidth = read_bandwidth(device=args.device)
    wbytes = weight_bytes(next(iter(engines.values())).engine.worker.model)
    roofline_ms = wbytes / bandwidth * 1e3
    eager = {k[:1] + k[2:]: v for k, v in med.items() if k[1] == "eager"}
    print("system | graph | batch | tokens/s | TPOT ms | vs eager | vs plain | batch-1 roofline use")
    print("---|---|---|---|---|---|---|---")
    report = {"bench": "graphs", "read_bandwidth_gbs": round(bandwidth / 1e9, 1),
              "weight_mb": round(wbytes / 1e6, 1), "roofline_ms": round(roofline_ms, 2), "results": {}}
    for (system, backend, size), (tps, tpot) in sorted(med.items()):
        base = eager.get((system, size))
        ratio = f"{tps / base[0]:.2f}x" if base else "-"
        use = roofline_ms / (tpot * 1e3) if size == 1 and system == "plain" else None
        plain = med.get(("plain", backend, size)) if system != "plain" else None
        print(f"{system} | {backend} | {size} | {tps:.1f} | {tpot * 1e3:.1f} | {ratio} | "
              f"{f'{tps / plain[0]:.2f}x' if plain else '-'} | {f'{use:.0%}' if use else '-'}")
        report["results"][f"{system}_{backend}_b{size}"] = {
            "tokens_per_s": round(tps, 2), "tpot_ms": round(tpot * 1e3, 2),
            **({"roofline_use": round(use, 3)} if use else {}),
            **({"vs_plain": round(tps / plain[0], 3)} if plain else {})}
    print(f"weights {wbytes / 1e6:.0f} MB, read bandwidth {bandwidth / 1e9:.1f} GB/s: "
          f"roofline {roofline_ms:.1f} ms per batch-1 step")
    report["runner"] = {f"{system}_{backend}": llm.engine.load().runner
                        for (system, backend), llm in engines.items()}
    print(json.dumps(report))
    return report
