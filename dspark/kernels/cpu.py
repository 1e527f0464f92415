"""dspark's bf16 kernels for x86 CPUs: small projections, short-query attention, a whole decoder
layer, a drafter's Markov head and the greedy argmax, as the operators `torch.ops.dspark_cpu.*`.

At a small batch a decode step is a chain of matrix-vector products, so its speed is how fast
the weights stream. oneDNN reads them at well under the machine's streaming bandwidth at one row
(its blocked layout included); `tile_linear` reads them at close to that bandwidth, from a copy
packed tile by tile (`pack_tiles`): through AMX tiles where the CPU has them, else through
AVX512-BF16 dot products for fewer rows (`tile_rows`). Attention through torch copies every
request's pages into a padded tensor and runs small batched matmuls whose fixed costs dwarf the
arithmetic; `paged_attention` reads the pages in place, for decode, verify and draft-block rows.

The library is built on first use (build.py) and loaded by `available()`, which also reads the
kernels' limits from it (MAX_ROWS, MAX_VECTOR_ROWS, MAX_QUERY, MAX_GROUP, MAX_HEAD_DIM: defined
once, in csrc/kernels.h) and registers the fake implementations (fake.py). Where it cannot be had
(another CPU, no compiler), torch's own kernels run, `available()` says why, once, in the log,
and the limits do not exist: every use of one sits behind `available()`.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import Tensor

from dspark.kernels.build import build, cache_dir, compiler
from dspark.kernels.fake import register_fakes

logger = logging.getLogger(__name__)

# Set from the library by `available()`; read from outside before it ran, they run it (__getattr__).
MAX_ROWS: int            # rows of x a projection takes (`tile_linear`, a fused layer)
MAX_VECTOR_ROWS: int     # ... a lone projection without AMX (`tile_rows`), more going to oneDNN
MAX_QUERY: int           # a step's longest query `paged_attention` serves; longer go to SDPA
MAX_GROUP: int           # query heads per K/V head it takes
MAX_HEAD_DIM: int        # head dimension it takes (an even one)
LIMITS = ("MAX_ROWS", "MAX_VECTOR_ROWS", "MAX_QUERY", "MAX_GROUP", "MAX_HEAD_DIM")


def __getattr__(name: str) -> int:
    if name in LIMITS:
        if available():
            return globals()[name]
        raise AttributeError(f"{name} is a limit of dspark's CPU kernels, which do not run here")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


@functools.cache
def available() -> bool:
    """Whether the kernels can run here; the first call builds and loads them."""
    if "avx512_bf16" not in cpu_flags():
        logger.info("this CPU has no AVX512-BF16: torch's kernels run bf16 decode steps")
        return False
    cxx = compiler()
    if cxx is None:
        logger.warning("no C++ compiler found: torch's kernels run bf16 decode steps, about half "
                       "as fast at batch 1")
        return False
    try:
        torch.ops.load_library(str(build(cxx)))
    except (RuntimeError, OSError) as err:
        logger.warning("dspark's CPU kernels are unavailable, torch's run bf16 decode steps: %s", err)
        return False
    limits = dict(torch.ops.dspark_cpu.limits())
    if set(limits) != set(LIMITS):
        raise RuntimeError(f"dspark's CPU kernels name the limits {sorted(limits)}, this module {sorted(LIMITS)}")
    globals().update(limits)
    register_fakes()
    return True


@functools.cache
def tiles_available() -> bool:
    """Whether `tile_linear` can run: the kernels load, the CPU has AMX and Linux grants this
    process its tile registers."""
    if not ({"amx_tile", "amx_bf16"} <= cpu_flags() and available()):
        logger.info("no AMX here: small bf16 projections stay on oneDNN")
        return False
    if not torch.ops.dspark_cpu.amx_init():
        logger.warning("Linux refused this process the AMX tile registers: small bf16 projections "
                       "stay on oneDNN, which reads weights about half as fast at batch 1")
        return False
    return True


def pack_tiles(weight: Tensor) -> Tensor:
    """bf16 [out, in] -> [ceil(out/16), ceil(in/32), 16, 16, 2]: the weight tile by tile, as
    `tile_linear` streams it (a copy)."""
    return torch.ops.dspark_cpu.amx_pack(weight.detach())


def tile_linear(x: Tensor, tiles: Tensor, out: int, bias: Tensor | None, amx: bool) -> Tensor:
    """x [M, in] @ weight^T (+ bias) -> [M, out] bf16, M <= MAX_ROWS, from pack_tiles(weight).
    amx: through AMX tiles (tiles_available()), else AVX512-BF16 dot products."""
    return torch.ops.dspark_cpu.linear_bf16(x, tiles, out, bias, amx)


def tile_rows(amx: bool) -> int:
    """Rows of x a lone projection (`linear`) takes from the tile copy, more going to oneDNN:
    MAX_ROWS with AMX; with dot products MAX_VECTOR_ROWS, past which oneDNN wins on the wide LM
    heads (a fused layer's own projections keep up with it to MAX_ROWS either way:
    fused_stack.py). Only where the kernels load."""
    return MAX_ROWS if amx else MAX_VECTOR_ROWS


def takes_attention(q: Tensor, k_cache: Tensor, max_q: int) -> bool:
    """Whether `paged_attention` serves this step: bf16 on a CPU where the kernels load, queries
    of at most MAX_QUERY rows, at most MAX_GROUP query heads per K/V head and an even head
    dimension of at most MAX_HEAD_DIM."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
            and available() and max_q <= MAX_QUERY and q.shape[1] <= MAX_GROUP * k_cache.shape[1]
            and q.shape[2] % 2 == 0 and q.shape[2] <= MAX_HEAD_DIM)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    token_keys: Tensor, block_size: int, scale: float, tiles: bool | None = None) -> Tensor:
    """Each token over its request's keys, read in place: q [T, H, D], caches [S, KVH, D],
    block_tables [R, NB] (key l of request r lives in slot table[r, l // block_size] *
    block_size + l % block_size), token_keys [T, 3] = (request, first key, end key) -> [T, H, D]
    bf16. Scores and softmax in fp32 (the torch path rounds scores to bf16 first). tiles: score
    through AMX (default: where the CPU has it) or with AVX512-BF16 dot products, which also
    weigh the values with the softmax rounded to bf16, as the torch path does."""
    tiles = tiles_available() if tiles is None else tiles
    return torch.ops.dspark_cpu.paged_attention_bf16(q, k_cache, v_cache, block_tables, token_keys,
                                                    block_size, scale, tiles)


def greedy_tokens(logits: Tensor) -> Tensor:
    """logits [R, V] -> [R] the first maximum of each row, as `argmax(-1)` answers (NaN counts
    as the maximum). fp32 rows on a CPU where the kernels load take `argmax_rows_f32`: torch's
    argmax walks each vocabulary-wide row element by element, a visible share of a small greedy
    verify step (docs/measurements.md)."""
    if logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu" and available():
        return torch.ops.dspark_cpu.argmax_rows_f32(logits)
    return logits.argmax(-1)


__all__ = ["available", "cache_dir", "cpu_flags", "greedy_tokens", "pack_tiles", "paged_attention",
           "takes_attention", "tile_linear", "tile_rows", "tiles_available"]   # and the LIMITS, once loaded
