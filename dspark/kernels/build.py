"""Compiling the sources in csrc/ into one shared library, once per machine.

The system C++ compiler (as torch.compile's CPU backend uses it) compiles every source side by
side, since the torch headers dominate each, and the library is kept in a cache folder under a
name keyed by the sources, torch, the compiler and its flags: only a changed source, torch or
compiler builds again. A build takes minutes on a small machine, so it is announced before and
timed after, even where the command line shows only warnings: a first `dspark demo` that sits
silent that long looks hung.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from dspark.config import cache_root

logger = logging.getLogger(__name__)
logger.setLevel(logging.INFO)            # the two build notices pass a warnings-only setup

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-std=c++20", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-DNDEBUG"]
SECONDS_PER_SOURCE = 12                  # a rough guess for one source on one core, for the notice


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def headers() -> list[Path]:
    return sorted(CSRC.glob("*.h"))


def cache_dir() -> Path:
    return cache_root() / "kernels"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _compile_command(cxx: str, source: Path, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()),
            "-c", str(source), "-o", str(out)]


def _link_command(cxx: str, objects: list[Path], out: Path) -> list[str]:
    from torch.utils.cpp_extension import library_paths
    libs = library_paths()
    return [cxx, "-shared", "-fopenmp", *map(str, objects), "-o", str(out),
            *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu"]


def _run_all(commands: list[list[str]]) -> None:
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    errors = [p.communicate()[1] for p in procs]
    for p, err in zip(procs, errors):
        if p.returncode != 0:
            raise RuntimeError(f"compiling dspark's CPU kernels failed:\n{err[-2000:]}")


def library_path(cxx: str) -> Path:
    """Where the build of these sources by this torch and compiler lives, built or not."""
    digest = hashlib.sha256(torch.__version__.encode() + cxx.encode() + " ".join(FLAGS).encode())
    for path in (*sources(), *headers()):
        digest.update(path.name.encode() + path.read_bytes())
    return cache_dir() / f"dspark_cpu-{digest.hexdigest()[:16]}.so"


def build(cxx: str) -> Path:
    """The compiled library: the cached one, else a new build (atomic: concurrent processes
    never load a half-written file)."""
    lib = library_path(cxx)
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    srcs = sources()
    guess = SECONDS_PER_SOURCE * math.ceil(len(srcs) / (os.cpu_count() or 1))
    logger.info("compiling dspark's CPU kernels into %s (once per machine; about %d s)", lib.parent, guess)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in srcs]
        _run_all([_compile_command(cxx, src, obj) for src, obj in zip(srcs, objects)])
        part = Path(tmp) / lib.name
        _run_all([_link_command(cxx, objects, part)])
        os.replace(part, lib)
    logger.info("compiled dspark's CPU kernels in %.0f s", time.perf_counter() - start)
    return lib
