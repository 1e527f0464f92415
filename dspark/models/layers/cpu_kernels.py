"""dspark's bf16 kernels for x86 CPUs: small projections and short-query attention.

At a small batch a decode step is a chain of matrix-vector products, so its speed is how fast
the weights stream. oneDNN reads them at half to two thirds of the machine's streaming bandwidth
at one row (its blocked layout included); `tile_linear` reads them at close to that bandwidth,
from a copy packed tile by tile (`pack_tiles`): through AMX tiles for up to 64 rows where the CPU
has them, else through AVX512-BF16 dot products for up to 16 (`tile_rows`). Attention through torch copies
every request's pages into a padded tensor and runs small batched matmuls whose fixed costs dwarf
the arithmetic; `paged_attention` reads the pages in place, for decode, verify and draft-block
rows (scores through AMX tiles where the CPU has them, else AVX512-BF16 dot products).

The sources in `csrc/` are compiled on first use with the system C++ compiler (as torch.compile's
CPU backend is) into a cache folder keyed by the sources, torch and compiler, and registered as
the operators `torch.ops.dspark_cpu.*`. Where it cannot be had (another CPU, no compiler), torch's
own kernels run: `available()` says why, once, in the log.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from dspark.config import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "cpu_kernels.cpp", CSRC / "paged_attention.cpp", CSRC / "tile_attention.cpp",
           CSRC / "decoder_layer.cpp", CSRC / "markov_head.cpp", CSRC / "argmax.cpp",
           CSRC / "vector_linear.cpp", CSRC / "vector_attention.cpp")   # compiled side by side
HEADERS = (CSRC / "cpu_kernels.h",)
MAX_ROWS = 64                    # rows of x `tile_linear` takes through AMX; more go to oneDNN
MAX_VECTOR_ROWS = 16             # ... a lone one through AVX512-BF16 dot products (tile_rows)
FLAGS = ["-O3", "-std=c++20", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-DNDEBUG"]


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _compile_command(compiler: str, source: Path, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()),
            "-c", str(source), "-o", str(out)]


def _link_command(compiler: str, objects: list[Path], out: Path) -> list[str]:
    from torch.utils.cpp_extension import library_paths
    libs = library_paths()
    return [compiler, "-shared", "-fopenmp", *map(str, objects), "-o", str(out),
            *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu"]


def _run_all(commands: list[list[str]]) -> None:
    """Run the commands side by side (one per source: the torch headers dominate each)."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    errors = [p.communicate()[1] for p in procs]
    for p, err in zip(procs, errors):
        if p.returncode != 0:
            raise RuntimeError(f"compiling dspark's CPU kernels failed:\n{err[-2000:]}")


def _build(compiler: str) -> Path:
    """Compile the kernels unless a build of the same sources, torch and compiler is cached."""
    digest = hashlib.sha256(torch.__version__.encode() + compiler.encode() + " ".join(FLAGS).encode())
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    lib = cache_dir() / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        logger.info("compiling dspark's CPU kernels (once, cached in %s)", lib.parent)
        _run_all([_compile_command(compiler, src, obj) for src, obj in zip(SOURCES, objects)])
        part = Path(tmp) / lib.name
        _run_all([_link_command(compiler, objects, part)])
        os.replace(part, lib)            # atomic: concurrent ranks never load a half-written file
    return lib


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
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler found: torch's kernels run bf16 decode steps, about half "
                       "as fast at batch 1")
        return False
    try:
        torch.ops.load_library(str(_build(compiler)))
    except (RuntimeError, OSError) as err:
        logger.warning("dspark's CPU kernels are unavailable, torch's run bf16 decode steps: %s", err)
        return False
    torch.library.register_fake("dspark_cpu::linear_bf16")(_linear_shape)
    torch.library.register_fake("dspark_cpu::paged_attention_bf16")(_attention_shape)
    torch.library.register_fake("dspark_cpu::argmax_rows_f32")(_argmax_shape)
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


def _linear_shape(x: Tensor, tiles: Tensor, out: int, bias: Tensor | None, amx: bool) -> Tensor:
    return x.new_empty((x.shape[0], out))


def _argmax_shape(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[:1], dtype=torch.long)


def _attention_shape(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                     token_keys: Tensor, block_size: int, scale: float, tiles: bool = False) -> Tensor:
    return torch.empty_like(q)


def pack_tiles(weight: Tensor) -> Tensor:
    """bf16 [out, in] -> [ceil(out/16), ceil(in/32), 16, 16, 2]: the weight tile by tile, as
    `tile_linear` streams it (a copy)."""
    return torch.ops.dspark_cpu.amx_pack(weight.detach())


def tile_linear(x: Tensor, tiles: Tensor, out: int, bias: Tensor | None, amx: bool) -> Tensor:
    """x [M, in] @ weight^T (+ bias) -> [M, out] bf16, M <= tile_rows(amx), from pack_tiles(weight).
    amx: through AMX tiles (tiles_available()), else AVX512-BF16 dot products."""
    return torch.ops.dspark_cpu.linear_bf16(x, tiles, out, bias, amx)


def tile_rows(amx: bool) -> int:
    """Rows of x a lone projection (`linear`) takes from the tile copy, more going to oneDNN: up
    to 64 with AMX; with dot products, 16, past which oneDNN wins on the wide LM heads (a fused
    layer's own projections keep up with it to 64 rows either way: fused_stack.py)."""
    return MAX_ROWS if amx else MAX_VECTOR_ROWS


MAX_QUERY = 16                   # a step's longest query `paged_attention` serves; longer go to SDPA
MAX_GROUP = 8                    # query heads per K/V head it takes


def takes_attention(q: Tensor, k_cache: Tensor, max_q: int) -> bool:
    """Whether `paged_attention` serves this step: queries of at most MAX_QUERY rows and at most
    MAX_GROUP query heads per K/V head, bf16 on a CPU where the kernels load."""
    return (max_q <= MAX_QUERY and q.device.type == "cpu" and q.dtype == torch.bfloat16
            and k_cache.dtype == torch.bfloat16 and q.shape[1] <= MAX_GROUP * k_cache.shape[1]
            and available())


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


__all__ = ["MAX_GROUP", "MAX_QUERY", "MAX_ROWS", "MAX_VECTOR_ROWS", "available", "cache_dir", "cpu_flags", "greedy_tokens",
           "pack_tiles", "paged_attention", "takes_attention", "tile_linear", "tile_rows", "tiles_available"]
