"""`cuda` tests run only where asked for: on a machine without a GPU, a run whose `-m` expression
does not name `cuda` (a bare `pytest`, `-m slow`, `-m "not cuda"`) deselects them (reported as
deselected), and a run whose `-m` names `cuda` and still selects some (`-m cuda`, as
.ci/gpu-check does) fails at once with a usage error instead of reporting failures or skips."""

from __future__ import annotations

import re

import pytest
import torch

# an identifier of a pytest -m expression (pytest's own tokenizer accepts these characters)
_IDENTIFIER = re.compile(r"(?:\w|:|\+|-|\.|\[|\]|\\|/)+")


def names_cuda(markexpr: str) -> bool:
    """Whether the -m expression mentions the `cuda` mark at all."""
    return "cuda" in _IDENTIFIER.findall(markexpr or "")


@pytest.hookimpl(trylast=True)          # after -m / -k have deselected what they deselect
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items or torch.cuda.is_available():
        return
    markexpr = config.option.markexpr
    if names_cuda(markexpr):
        raise pytest.UsageError(f"cuda tests selected (-m {markexpr!r}) but no CUDA device is "
                                f"available ({len(cuda_items)} tests; torch {torch.__version__})")
    config.hook.pytest_deselected(items=cuda_items)
    items[:] = [item for item in items if not item.get_closest_marker("cuda")]
