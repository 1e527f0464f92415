"""`cuda` tests run only where asked for: a bare `pytest` on a machine without a GPU deselects
them (reported as deselected), and a run that selects them (`-m cuda`, as .ci/gpu-check does)
on a machine without a GPU fails at once instead of reporting failures or skips."""

from __future__ import annotations

import pytest
import torch
from _pytest.mark.expression import Expression


def _selects_cuda(markexpr: str) -> bool:
    """Whether the -m expression keeps a test marked `cuda` alone."""
    return bool(markexpr) and Expression.compile(markexpr).evaluate(lambda name, **_: name == "cuda")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items or torch.cuda.is_available():
        return
    markexpr = config.option.markexpr
    if _selects_cuda(markexpr):
        raise pytest.UsageError(f"cuda tests were selected (-m {markexpr!r}) but no CUDA device is "
                                "available")
    if not markexpr:
        config.hook.pytest_deselected(items=cuda_items)
        items[:] = [item for item in items if not item.get_closest_marker("cuda")]
