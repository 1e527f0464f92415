"""The limits the kernels take, defined once in C++ and read by Python from `limits`; amx_init;
and Python without the kernels."""

import pytest
import torch

from dspark.kernels import cpu as kernels
from kernel_paths import PATH_MARKS
from kernel_inputs import BF16, paged

needs_kernels = PATH_MARKS[False]


@needs_kernels
def test_python_reads_the_limits_the_kernels_enforce():
    limits = torch.ops.dspark_cpu.limits()
    assert set(limits) == set(kernels.LIMITS)
    assert all(getattr(kernels, name) == value > 0 for name, value in limits.items())
    tiles = kernels.pack_tiles(torch.randn(8, 32).to(BF16))
    kernels.tile_linear(torch.randn(kernels.MAX_ROWS, 32).to(BF16), tiles, 8, None, False)
    with pytest.raises(RuntimeError, match="bf16 rows"):
        kernels.tile_linear(torch.randn(kernels.MAX_ROWS + 1, 32).to(BF16), tiles, 8, None, False)
    assert kernels.tile_rows(True) == kernels.MAX_ROWS and kernels.tile_rows(False) == kernels.MAX_VECTOR_ROWS
    for heads, dim in [(kernels.MAX_GROUP + 1, 32), (2, kernels.MAX_HEAD_DIM + 2)]:
        k_cache, v_cache, tables, _ = paged(1, 1, dim, 4, 8, seed=0)
        q = torch.randn(1, heads, dim).to(BF16)
        assert not kernels.takes_attention(q, k_cache, 1)
        with pytest.raises(RuntimeError, match="paged attention"):
            kernels.paged_attention(q, k_cache, v_cache, tables, torch.tensor([[0, 0, 8]]), 4, 0.1, False)
    k_cache, _, _, _ = paged(1, 1, 32, 4, 8, seed=0)
    q = torch.randn(1, kernels.MAX_GROUP, 32).to(BF16)
    assert kernels.takes_attention(q, k_cache, kernels.MAX_QUERY)
    assert not kernels.takes_attention(q, k_cache, kernels.MAX_QUERY + 1)


@needs_kernels
def test_amx_init_is_granted_only_where_the_cpu_has_amx():
    """Linux grants the tile registers (ARCH_REQ_XCOMP_PERM) on AMX CPUs and refuses elsewhere."""
    if {"amx_tile", "amx_bf16"} <= kernels.cpu_flags():
        assert torch.ops.dspark_cpu.amx_init() == kernels.tiles_available()
    else:
        assert not torch.ops.dspark_cpu.amx_init() and not kernels.tiles_available()


def test_without_the_kernels_python_runs_and_has_no_limits(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    for name in kernels.LIMITS:
        monkeypatch.delattr(kernels, name, raising=False)
    with pytest.raises(AttributeError, match="do not run here"):
        kernels.MAX_ROWS
    q, k_cache = torch.randn(1, 2, 32).to(BF16), torch.randn(8, 1, 32).to(BF16)
    assert not kernels.takes_attention(q, k_cache, 1)
    logits = torch.randn(3, 50)
    assert torch.equal(kernels.greedy_tokens(logits), logits.argmax(-1))
