"""`dspark demo`: the embedded model answering a few chat and code prompts, with its speed.

Speculative decoding joins this demo (side by side with plain decoding) once a drafter ships.
"""

from __future__ import annotations

import time

from dspark.bench.prompts import CHAT, CODE


def run_demo(args) -> None:
    from dspark import LLM, SamplingParams
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads)
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT[:2]] + CODE[:2]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate(ids[:1], SamplingParams(temperature=0, max_tokens=4))        # warm-up
    print("== plain decoding (target only), batch 1, greedy ==")
    total_tokens, total_time = 0, 0.0
    for text, p in zip(CHAT[:2] + CODE[:2], ids):
        start = time.perf_counter()
        out = llm.generate([p], params)[0]
        elapsed = time.perf_counter() - start
        total_tokens += len(out.token_ids)
        total_time += elapsed
        print(f"\n>>> {text.strip()}\n{out.text.strip()}")
        print(f"    [{len(out.token_ids)} tokens, {len(out.token_ids) / elapsed:.1f} tokens/s]")
    print(f"\nplain decoding: {total_tokens / total_time:.1f} tokens/s over {total_tokens} tokens")
