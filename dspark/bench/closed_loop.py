"""A closed loop: decode prompts through an engine with a fixed number of requests in flight,
replacing a finished request at once, as a client holding that many connections does (vLLM's
`--max-concurrency`). The dp and sweep benchmarks measure throughput this way."""

from __future__ import annotations

import time


def closed_loop(engine, prompts: list[list[int]], params, concurrency: int) -> dict:
    """Decode every prompt with `concurrency` requests in flight (`params`: one SamplingParams
    for all, or a list, one per prompt); -> tokens/s and step counts."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    queue, in_flight, tokens, steps = list(zip(prompts, per_prompt)), 0, 0, 0
    start = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            engine.add_request(*queue.pop())
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                tokens += len(out.token_ids)
        steps += 1
    seconds = time.perf_counter() - start
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "steps": steps}
