"""`dspark bench --mode kernels`: each of dspark's CPU kernels at the shapes the embedded model
(SmolLM2-135M and its drafter) gives it, timed alone: the median time of a call, the bandwidth it
achieves over the bytes it must read (weights, K/V, logits) against the machine's streaming read
bandwidth, and, where torch has a way to do the same work, torch's time measured interleaved with
the kernel's (each repetition times both in turn over the same number of calls).

In a decode step every layer's weights and K/V come from memory, not from a cache warmed by the
previous call; so each case cycles through enough copies of them to overflow the caches
(`cold_bytes`), and the figures are those of a stream, as in a step. Logits, which the LM head has
just written, stay warm.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark.bench.roofline import read_bandwidth
from dspark.runner.choice import interleaved_medians_ms
from dspark.kernels import cpu as kernels
from dspark.models.layers.linear import linear, pack_weight

BF16 = torch.bfloat16
T = TypeVar("T")


@dataclass(frozen=True)
class Shapes:
    """A target and drafter's sizes, and the steps the kernels are timed at."""
    hidden: int = 576
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    intermediate: int = 1536
    vocab: int = 49152
    draft_vocab: int = 8192
    markov_rank: int = 64
    gamma: int = 7
    context: int = 512           # keys each request attends to
    block_size: int = 16
    rows: tuple[int, ...] = (1, 8)   # a decode row; a verify block of one request


SMOLLM2 = Shapes()


@dataclass
class Case:
    op: str
    name: str
    path: str                                  # "vector" (AVX512-BF16), "amx", or "-" (one path)
    run: Callable[[], object]
    bytes: int                                 # what one call must read from memory (each byte once)
    torch: Callable[[], object] | None = None  # torch doing the same work, where it can
    flops: int = 0                             # multiply-adds x 2 (0: not a matter of arithmetic)


class Cold:
    """How many copies of what a case reads overflow the caches."""

    def __init__(self, cold_bytes: int, max_copies: int = 256):
        self.cold_bytes, self.max_copies = cold_bytes, max_copies

    def copies(self, make: Callable[[], T], nbytes: int) -> Callable[[], T]:
        """A callable answering the next of enough copies made by `make`, round and round."""
        n = max(1, min(self.max_copies, -(-self.cold_bytes // max(nbytes, 1))))
        return itertools.cycle([make() for _ in range(n)]).__next__


def _w(*shape: int, scale: float = 0.05) -> Tensor:
    return (torch.randn(*shape) * scale).to(BF16)


def _path(amx: bool) -> str:
    return "amx" if amx else "vector"


def _projections(s: Shapes) -> dict[str, tuple[int, int]]:
    kv = s.kv_heads * s.head_dim
    return {"qkv": (s.heads * s.head_dim + 2 * kv, s.hidden), "o": (s.hidden, s.heads * s.head_dim),
            "gate_up": (2 * s.intermediate, s.hidden), "down": (s.hidden, s.intermediate),
            "lm_head": (s.vocab, s.hidden)}


def _torch_pack(w: Tensor) -> Tensor:
    """amx_pack's layout by padding and permuting."""
    out, cols = w.shape
    padded = F.pad(w, (0, -cols % 32, 0, -out % 16))
    return padded.view(-(-out // 16), 16, -(-cols // 32), 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def _pack_cases(s: Shapes, cold: Cold) -> Iterator[Case]:
    w = _w(2 * s.intermediate, s.hidden)
    weight = cold.copies(w.clone, w.numel() * 2)
    yield Case("amx_pack", f"gate_up {w.shape[0]}x{w.shape[1]}", "-", lambda: kernels.pack_tiles(weight()),
               w.numel() * 2, lambda: _torch_pack(weight()))


def _linear_cases(s: Shapes, cold: Cold, paths: list[bool]) -> Iterator[Case]:
    for name, (out, cols) in _projections(s).items():
        w = _w(out, cols)
        tiles = cold.copies(lambda: kernels.pack_tiles(w), w.numel() * 2)
        packed = cold.copies(lambda: pack_weight(w), w.numel() * 2)
        for rows in s.rows:
            x = _w(rows, cols, scale=1.0)
            for amx in paths:
                yield Case("linear_bf16", f"{name} {out}x{cols}, {rows} rows", _path(amx),
                           lambda x=x, o=out, a=amx, tiles=tiles: kernels.tile_linear(x, tiles(), o, None, a),
                           w.numel() * 2, lambda x=x, w=w, packed=packed: linear(x, w, packed()),
                           2 * rows * w.numel())


def _pages(s: Shapes, requests: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Caches of `requests` x context keys in shuffled pages, their block tables and the slots."""
    nb = -(-s.context // s.block_size)
    k_cache = _w(requests * nb * s.block_size, s.kv_heads, s.head_dim, scale=1.0)
    v_cache = _w(requests * nb * s.block_size, s.kv_heads, s.head_dim, scale=1.0)
    tables = torch.randperm(requests * nb).view(requests, nb)
    pos = torch.arange(s.context)
    slots = tables[:, pos // s.block_size] * s.block_size + pos % s.block_size          # [R, L]
    return k_cache, v_cache, tables, slots


def _attention_cases(s: Shapes, cold: Cold, paths: list[bool]) -> Iterator[Case]:
    scale = s.head_dim ** -0.5
    for q_len, requests in [(1, 4), (max(s.rows), 1)]:        # decode rows; a verify block
        k_cache, v_cache, tables, slots = _pages(s, requests)
        nbytes = requests * s.context * 2 * s.kv_heads * s.head_dim * 2
        caches = cold.copies(lambda: (k_cache.clone(), v_cache.clone()), nbytes)
        keys = torch.tensor([[r, 0, s.context - q_len + j + 1] for r in range(requests) for j in range(q_len)])
        q = _w(requests * q_len, s.heads, s.head_dim, scale=1.0)
        causal = torch.arange(s.context)[None] <= torch.arange(s.context - q_len, s.context)[:, None]

        def torch_path(q=q, slots=slots, causal=causal, q_len=q_len, caches=caches):   # pages gathered, SDPA
            kc, vc = caches()
            k, v = kc[slots].transpose(1, 2), vc[slots].transpose(1, 2)                  # [R, KVH, L, D]
            qr = q.view(-1, q_len, s.heads, s.head_dim).transpose(1, 2)
            return F.scaled_dot_product_attention(qr, k, v, attn_mask=causal, scale=scale, enable_gqa=True)

        for tiles in paths:
            yield Case("paged_attention_bf16", f"{requests} x {q_len} rows, {s.context} keys", _path(tiles),
                       lambda q=q, t=tables, k=keys, a=tiles, caches=caches: kernels.paged_attention(
                           q, *caches(), t, k, s.block_size, scale, a),
                       nbytes, torch_path, requests * q_len * 4 * s.heads * s.head_dim * s.context)


def _argmax_cases(s: Shapes) -> Iterator[Case]:
    for rows in s.rows:                 # the logits the LM head has just written: warm, as in a step
        logits = torch.randn(rows, s.vocab)
        yield Case("argmax_rows_f32", f"{rows} x {s.vocab}", "-",
                   lambda logits=logits: torch.ops.dspark_cpu.argmax_rows_f32(logits),
                   rows * s.vocab * 4, lambda logits=logits: logits.argmax(-1))


def _markov_cases(s: Shapes, cold: Cold, paths: list[bool]) -> Iterator[Case]:
    d, r, v = s.hidden, s.markov_rank, s.draft_vocab
    w1, w2, conf_w, conf_b = _w(s.vocab, r, scale=1.0), _w(v, r), _w(1, d + r), _w(1)
    conf_tiles, to_target = kernels.pack_tiles(conf_w), torch.randperm(s.vocab)[:v]
    head = cold.copies(lambda: (w2.clone(), kernels.pack_tiles(w2)), w2.numel() * 2)
    for rows in s.rows:                 # the base logits warm (just written), W2 from memory
        base, h = torch.randn(rows, s.gamma, v), _w(rows, s.gamma, d, scale=1.0)
        anchors = torch.randint(0, s.vocab, (rows,))
        nbytes = (w2.numel() + conf_w.numel()) * 2 + base.numel() * 4

        def torch_loop(base=base, h=h, anchors=anchors):      # the head's γ rounds in torch
            w2_, _ = head()
            prev, confidences = anchors, []
            for k in range(s.gamma):
                e = w1[prev]
                best = (base[:, k] + F.linear(e, w2_).float()).argmax(-1)
                confidences.append(F.linear(torch.cat([h[:, k], e], -1), conf_w, conf_b))
                prev = to_target[best]
            return prev, confidences

        def kernel(base=base, h=h, anchors=anchors, amx=False):
            return torch.ops.dspark_cpu.markov_greedy_bf16(base, h, anchors, w1, head()[1], conf_tiles, conf_b,
                                                           to_target, amx)

        for amx in paths:
            yield Case("markov_greedy_bf16", f"{rows} x gamma {s.gamma}, vocab {v}, rank {r}", _path(amx),
                       lambda kernel=kernel, a=amx: kernel(amx=a), nbytes, torch_loop,
                       2 * s.gamma * rows * (w2.numel() + conf_w.numel()))


def _layer_cases(s: Shapes, cold: Cold, paths: list[bool]) -> Iterator[Case]:
    weights = {name: _w(*shape) for name, shape in _projections(s).items() if name != "lm_head"}
    kv_bytes = s.context * 2 * s.kv_heads * s.head_dim * 2
    nbytes = sum(w.numel() * 2 for w in weights.values()) + kv_bytes
    per_row = 2 * sum(w.numel() for w in weights.values()) + 4 * s.heads * s.head_dim * s.context
    k_cache, v_cache, tables, slots = _pages(s, 1)
    layers = cold.copies(lambda: ({n: kernels.pack_tiles(w) for n, w in weights.items()},
                                  k_cache.clone(), v_cache.clone()), nbytes)
    norm = torch.ones(s.hidden, dtype=BF16)
    for rows in s.rows:
        x = _w(rows, s.hidden, scale=1.0)
        cos, sin = torch.ones(rows, s.head_dim, dtype=BF16), torch.zeros(rows, s.head_dim, dtype=BF16)
        keys = torch.tensor([[0, 0, s.context - rows + j + 1] for j in range(rows)])
        row_slots = slots[0, s.context - rows:]

        def layer(x=x, cos=cos, sin=sin, keys=keys, row_slots=row_slots, amx=False):
            t, kc, vc = layers()
            return torch.ops.dspark_cpu.decoder_layer_bf16(
                x, cos, sin, norm, t["qkv"], None, None, None, t["o"], norm, t["gate_up"], t["down"], kc, vc,
                row_slots, tables, keys, s.block_size, x.shape[0], s.heads,
                s.intermediate, 1e-5, s.head_dim ** -0.5, 0, amx)

        for amx in paths:
            yield Case("decoder_layer_bf16", f"{rows} rows, {s.context} keys", _path(amx),
                       lambda layer=layer, a=amx: layer(amx=a), nbytes, None, rows * per_row)


def _context_kv_cases(s: Shapes, cold: Cold, paths: list[bool]) -> Iterator[Case]:
    kv_size, rows = s.kv_heads * s.head_dim, max(s.rows)
    w = _w(2 * kv_size, s.hidden)
    kv_tiles = cold.copies(lambda: kernels.pack_tiles(w), w.numel() * 2)
    k_cache, v_cache, _, slots = _pages(s, 1)
    h, row_slots = _w(rows, s.hidden, scale=1.0), slots[0, :rows]
    cos, sin = torch.ones(rows, s.head_dim, dtype=BF16), torch.zeros(rows, s.head_dim, dtype=BF16)
    for amx in paths:
        yield Case("context_kv_bf16", f"{rows} rows, kv {2 * kv_size}x{s.hidden}", _path(amx),
                   lambda a=amx: torch.ops.dspark_cpu.context_kv_bf16(
                       h, cos, sin, kv_tiles(), None, k_cache, v_cache, row_slots, 1e-5, a),
                   w.numel() * 2, None, 2 * rows * w.numel())


def cases(s: Shapes, cold: Cold) -> Iterator[Case]:
    """Every case, built as it is reached (each holds its copies only while it runs)."""
    paths = [False, True] if kernels.tiles_available() else [False]
    yield from _pack_cases(s, cold)
    yield from _linear_cases(s, cold, paths)
    yield from _attention_cases(s, cold, paths)
    yield from _argmax_cases(s)
    yield from _markov_cases(s, cold, paths)
    yield from _layer_cases(s, cold, paths)
    yield from _context_kv_cases(s, cold, paths)


def median_seconds(fns: list[Callable[[], object]], repetitions: int, min_seconds: float) -> list[float]:
    """Seconds per call of each fn (median over repetitions), interleaved: each repetition times
    every fn in turn over the same number of calls, enough for the first to take min_seconds."""
    for fn in fns:
        fn()
    start = time.perf_counter()
    fns[0]()
    calls = max(1, int(min_seconds / max(time.perf_counter() - start, 1e-7)))
    loops = {i: (lambda fn=fn: [fn() for _ in range(calls)]) for i, fn in enumerate(fns)}
    ms = interleaved_medians_ms(loops, replays=repetitions, warmup=0)
    return [ms[i] / 1e3 / calls for i in range(len(fns))]


def _figure(x: float) -> float:
    return float(f"{x:.4g}")             # four significant digits, however small the case


def bench_kernels(s: Shapes, repetitions: int, min_seconds: float = 0.05, cold_bytes: int = 96 << 20,
                  stream_megabytes: int = 256) -> dict:
    """Time every case of `s`, print the table and the JSON line; -> the report."""
    stream = read_bandwidth(stream_megabytes)
    report: dict = {"bench": "kernels", "threads": torch.get_num_threads(),
                    "read_bandwidth_gbs": _figure(stream / 1e9), "results": {}}
    print("kernel | case | path | µs | GB/s | of stream | GFLOP/s | torch µs | vs torch")
    print("---|---|---|---|---|---|---|---|---")
    with torch.inference_mode():
        for case in cases(s, Cold(cold_bytes)):
            fns = [case.run] if case.torch is None else [case.run, case.torch]
            seconds = median_seconds(fns, repetitions, min_seconds)
            gbs = case.bytes / seconds[0] / 1e9
            row = {"us": _figure(seconds[0] * 1e6), "gbs": _figure(gbs), "mb": _figure(case.bytes / 1e6)}
            if case.flops:
                row["gflops"] = _figure(case.flops / seconds[0] / 1e9)
            if case.torch is not None:
                row |= {"torch_us": _figure(seconds[1] * 1e6), "speedup": _figure(seconds[1] / seconds[0])}
            print(f"{case.op} | {case.name} | {case.path} | {row['us']:.1f} | {gbs:.1f} | {gbs * 1e9 / stream:.0%} | "
                  + (f"{row['gflops']:.1f} | " if case.flops else "- | ")
                  + (f"{row['torch_us']:.1f} | {row['speedup']:.2f}x" if case.torch is not None else "- | -"))
            report["results"].setdefault(case.op, {})[f"{case.name} ({case.path})"] = row
    print(f"read bandwidth {stream / 1e9:.1f} GB/s (a streaming fp32 sum), {torch.get_num_threads()} threads; "
          f"each case cycles through {cold_bytes >> 20} MB of copies")
    print(json.dumps(report))
    return report


def run_kernels_bench(args) -> dict:
    if not kernels.available():
        raise SystemExit("dspark's CPU kernels do not run here (see the log): nothing to time")
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return bench_kernels(SMOLLM2, args.repetitions)
