"""`dspark demo`: the embedded pair on chat and code prompts, plain and DSpark side by side.

Both engines decode greedily, so DSpark must print exactly the plain text; the demo checks that
and reports tokens/s for both, the speed-up, τ and per-position acceptance.
"""

from __future__ import annotations

import time

from dspark.bench.prompts import CHAT, CODE


def _prompts(tok) -> list[tuple[str, list[int]]]:
    chat = [(p, tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                           add_special_tokens=False)) for p in CHAT[:2]]
    code = [(p, tok.encode(p)) for p in CODE[:2]]
    return chat + code


def _timed(llm, ids, params):
    start = time.perf_counter()
    out = llm.generate([ids], params)[0]
    return out, time.perf_counter() - start


def _agreement(spec: list[int], plain: list[int], dtype: str) -> str:
    if spec == plain:
        return "identical"
    at = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b), min(len(spec), len(plain)))
    if dtype == "float32":
        return f"DIFFERENT from token {at} (a bug: float32 decoding must be identical)"
    return (f"parts from plain at token {at} ({dtype}: a verify row and a decode step round "
            f"differently, so near-ties can flip; --dtype float32 decodes identically)")


def run_demo(args) -> None:
    from dspark import SamplingParams
    from dspark.bench.engines import plain_and_spec
    from dspark.cli import format_spec_stats
    plain, spec = plain_and_spec(args)
    if spec is None and not args.no_drafter:
        print("(no drafter for this model: pass --drafter to compare; showing plain decoding only)")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts = _prompts(plain.tokenizer)
    for llm in filter(None, (plain, spec)):
        llm.generate([prompts[0][1]], SamplingParams(temperature=0, max_tokens=8))   # warm-up
        llm.engine.reset_spec_stats()
    totals = {"plain": [0, 0.0], "dspark": [0, 0.0]}
    for text, ids in prompts:
        ref, t_plain = _timed(plain, ids, params)
        totals["plain"][0] += len(ref.token_ids)
        totals["plain"][1] += t_plain
        print(f"\n>>> {text.strip()}\n{ref.text.strip()}")
        line = f"    plain {len(ref.token_ids) / t_plain:.1f} tokens/s"
        if spec is not None:
            out, t_spec = _timed(spec, ids, params)
            totals["dspark"][0] += len(out.token_ids)
            totals["dspark"][1] += t_spec
            same = _agreement(out.token_ids, ref.token_ids, args.dtype)
            line += (f" | DSpark {len(out.token_ids) / t_spec:.1f} tokens/s "
                     f"({t_plain / t_spec:.2f}x), output {same}, tau {out.spec.mean_accepted_length:.2f}")
        print(line)
    plain_tps = totals["plain"][0] / totals["plain"][1]
    print(f"\nplain decoding: {plain_tps:.1f} tokens/s")
    if spec is not None:
        spec_tps = totals["dspark"][0] / totals["dspark"][1]
        print(f"DSpark:         {spec_tps:.1f} tokens/s, speed-up {spec_tps / plain_tps:.2f}x")
        print(f"DSpark rounds:  {format_spec_stats(spec.engine.spec_stats)}")
