"""dspark's bf16 kernels for CPUs with AVX512-BF16: small projections and decode attention.

At batch 1 a decode step is a chain of matrix-vector products, so its speed is how fast the
weights stream. oneDNN reads them at about half the machine's streaming bandwidth at one row
(its blocked layout included); `gemv` reads each weight row once for all rows of x, prefetching
ahead, at close to that bandwidth. Decode attention through torch copies every request's pages
into a padded tensor and runs small batched matmuls whose fixed costs dwarf the arithmetic;
`decode_attention` reads the pages in place.

`csrc/cpu_kernels.cpp` is compiled on first use with the system C++ compiler (as torch.compile's
CPU backend is) into a cache folder keyed by the source, torch and compiler, and registered as
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

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
MAX_ROWS = 8                     # rows of x `gemv` takes; more go to oneDNN
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512bf16", "-DNDEBUG"]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dspark" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _command(compiler: str, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = library_paths()
    return [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()),
            str(SOURCE), "-shared", "-o", str(out), *(f"-L{p}" for p in libs),
            *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu"]


def _build(compiler: str) -> Path:
    """Compile the kernel unless a build of the same source, torch and compiler is cached."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + compiler.encode()
                         + " ".join(FLAGS).encode()).hexdigest()[:16]
    lib = cache_dir() / f"cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        part = Path(tmp) / lib.name
        logger.info("compiling dspark's CPU kernels (once, cached in %s)", lib.parent)
        done = subprocess.run(_command(compiler, part), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{done.stderr[-2000:]}")
        os.replace(part, lib)            # atomic: concurrent ranks never load a half-written file
    return lib


def cpu_has_avx512_bf16() -> bool:
    """Whether the CPU has VDPBF16PS, which the kernels are built on (from /proc/cpuinfo)."""
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


@functools.cache
def available() -> bool:
    """Whether the kernels can run here; the first call builds and loads them."""
    if not cpu_has_avx512_bf16():
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
    torch.library.register_fake("dspark_cpu::gemv_bf16")(_gemv_shape)
    torch.library.register_fake("dspark_cpu::decode_attention_bf16")(_attention_shape)
    return True


def _gemv_shape(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def _attention_shape(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                     mask: Tensor | None, block_size: int, kv_len: int, scale: float) -> Tensor:
    return torch.empty_like(q)


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, in] @ weight [out, in]^T (+ bias) -> [M, out] bf16, M <= MAX_ROWS."""
    return torch.ops.dspark_cpu.gemv_bf16(x, weight, bias)


def takes_decode(q: Tensor, k_cache: Tensor) -> bool:
    """Whether `decode_attention` serves this step: bf16 on a CPU where the kernels load."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
            and available())


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                     mask: Tensor | None, block_size: int, kv_len: int, scale: float) -> Tensor:
    """One query row per request over its pages: q [R, H, D], caches [S, KVH, D], block_tables
    [R, NB] (token l of request r lives in slot table[r, l // block_size] * block_size + l %
    block_size), mask [R, kv_len] True = attend or None (all kv_len keys) -> [R, H, D] bf16.
    Scores and softmax in fp32 (the torch path rounds scores to bf16 first)."""
    return torch.ops.dspark_cpu.decode_attention_bf16(q, k_cache, v_cache, block_tables, mask,
                                                     block_size, kv_len, scale)


__all__ = ["MAX_ROWS", "available", "cache_dir", "cpu_has_avx512_bf16", "decode_attention", "gemv",
           "takes_decode"]
