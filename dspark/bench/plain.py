"""`dspark bench --mode plain`: dspark plain decoding beside transformers' generate.

Both run the same dense weights (our dequantized GGUF, bf16 by default), the same prompts and the
same thread count, interleaved repetition by repetition in one process; medians are reported.
Batch 1 decodes a fixed length; the batch run draws each request's output length from
[min_output, max_output]: dspark retires each request at its own length (continuous batching),
transformers' static batch runs to the longest, and both are credited only the requested tokens.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass

import torch

from dspark.bench.prompts import bench_prompts
from dspark.bench.roofline import read_bandwidth, weight_bytes


@dataclass
class RunResult:
    tokens: int
    seconds: float
    ttft: float                    # mean seconds to the first token
    tpot: float                    # mean seconds per output token after the first

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _dspark_run(llm, prompts: list[list[int]], lengths: list[int]) -> RunResult:
    from dspark import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    ttft = statistics.mean(o.metrics.ttft for o in outs)
    tpot = statistics.mean(o.metrics.tpot(len(o.token_ids)) or 0.0 for o in outs)
    return RunResult(sum(len(o.token_ids) for o in outs), seconds, ttft, tpot)


def _hf_run(model, prompts: list[list[int]], lengths: list[int], pad_id: int) -> RunResult:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    new = max(lengths)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                       pad_token_id=pad_id)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad_id)
        seconds = time.perf_counter() - start
    assert out.shape[1] == width + new
    return RunResult(sum(lengths), seconds, ttft, (seconds - ttft) / max(new - 1, 1))


def _hf_model(model_path: str | None, dtype: torch.dtype):
    """transformers' Llama holding our dequantized weights densely (its GGUF path stays packed)."""
    import transformers
    from dspark.config import default_model_path
    from dspark.models.gguf import load_gguf
    ckpt = load_gguf(model_path or default_model_path())
    cfg = {k: v for k, v in ckpt.config.items() if k not in ("architectures", "model_type")}
    config = transformers.LlamaConfig(**cfg)
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(ckpt.tensors, strict=False)
    model.tie_weights()
    return model.to(dtype).eval()


def _table(rows: list[tuple]) -> str:
    head = ("system", "batch", "tokens/s", "TTFT ms", "TPOT ms", "speed-up")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    lines += [" | ".join(str(c) for c in row) for row in rows]
    return "\n".join(lines)


def run_plain_bench(args) -> None:
    from dspark.llm import LLM
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    llm = LLM(args.model, dtype=args.dtype, num_threads=threads, max_num_seqs=max(64, args.batch), drafter=None)
    tok = llm.tokenizer
    prompts = [tok.encode(p) for p in bench_prompts(args.batch)]
    rng = random.Random(0)
    lengths = [rng.randint(args.min_output, args.max_output) for _ in prompts]
    cases = {"1": ([prompts[0]], [args.batch1_tokens]), str(args.batch): (prompts, lengths)}
    hf = None if args.no_hf else _hf_model(args.model, llm.engine.config.torch_dtype)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    results: dict[tuple[str, str], list[RunResult]] = {}
    for name, (ps, ls) in cases.items():          # warm-up
        _dspark_run(llm, ps, [min(8, n) for n in ls])
    for rep in range(args.repetitions):
        for name, (ps, ls) in cases.items():
            results.setdefault(("dspark", name), []).append(_dspark_run(llm, ps, ls))
            if hf is not None:
                results.setdefault(("transformers", name), []).append(_hf_run(hf, ps, ls, pad))
    med = {k: _median(v) for k, v in results.items()}
    bandwidth = read_bandwidth()
    wbytes = weight_bytes(llm.engine.worker.model)
    b1 = med[("dspark", "1")]
    util = wbytes / b1.tpot / bandwidth
    rows, summary = [], {"bench": "plain", "threads": threads, "dtype": args.dtype,
                         "read_bandwidth_gbs": round(bandwidth / 1e9, 1),
                         "weight_mb": round(wbytes / 1e6, 1), "batch1_bandwidth_utilisation": round(util, 3)}
    for (system, name), r in med.items():
        base = med.get(("transformers", name))
        speedup = r.tokens_per_s / base.tokens_per_s if base else None
        rows.append((system, name, f"{r.tokens_per_s:.1f}", f"{r.ttft * 1e3:.1f}", f"{r.tpot * 1e3:.1f}",
                     f"{speedup:.2f}x" if speedup else "-"))
        summary[f"{system}_b{name}"] = {"tokens_per_s": round(r.tokens_per_s, 2), "ttft_ms": round(r.ttft * 1e3, 2),
                                        "tpot_ms": round(r.tpot * 1e3, 2)}
        if system == "dspark" and speedup:
            summary[f"speedup_b{name}"] = round(speedup, 3)
    print(_table(rows))
    print(f"batch-1 decode: {b1.tpot * 1e3:.1f} ms/step; weights {wbytes / 1e6:.0f} MB; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s; roofline {wbytes / bandwidth * 1e3:.1f} ms/step; utilisation {util:.0%}")
    print(json.dumps(summary))


def _median(runs: list[RunResult]) -> RunResult:
    return RunResult(runs[0].tokens, statistics.median(r.seconds for r in runs),
                     statistics.median(r.ttft for r in runs), statistics.median(r.tpot for r in runs))
