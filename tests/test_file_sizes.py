"""A file holds one concept and is small enough to read whole: one over the limit is split along a
concept boundary, not given a higher limit."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dspark"
MAX_LINES = 400
KERNEL_SUFFIXES = {".cpp", ".h", ".cu", ".cuh"}


def sources() -> list[Path]:
    python = PACKAGE.rglob("*.py")
    kernels = (p for p in PACKAGE.rglob("*") if p.suffix in KERNEL_SUFFIXES and "csrc" in p.parts)
    return sorted({*python, *kernels})


def test_no_source_file_is_over_the_limit():
    sizes = {p: len(p.read_text().splitlines()) for p in sources()}
    over = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not over, f"files over {MAX_LINES} lines (split them by concept):\n" + "\n".join(over)


def test_the_scan_sees_the_kernels():
    assert any(p.suffix == ".cpp" for p in sources()), "no C++ sources found under dspark/**/csrc"
