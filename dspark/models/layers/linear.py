"""The projection layer every module uses, and its inference layout on CPUs.

A CPU decode step is a chain of few-row products, paced by how fast the weights stream. oneDNN
streams a bf16 weight faster in its own blocked layout (same kernel, bit-identical results), and
dspark's kernel (`cpu_kernels`) faster still at a few rows from its tile-by-tile copy
(docs/internals.md). An inference model is packed once after loading (runner/setup.py); training
never packs, because a packed copy does not follow updates to the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark.kernels import cpu as cpu_kernels


@torch.library.custom_op("dspark::packed_linear", mutates_args=())
def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., in] @ packed [out, in] (oneDNN layout) -> [..., out]. A custom op, so torch.compile
    calls it as one kernel instead of lowering an operator that expects a frozen constant."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def linear(x: Tensor, weight: Tensor, packed: Tensor | None, bias: Tensor | None = None,
           tiles: Tensor | None = None, amx: bool = False) -> Tensor:
    """x [..., in] -> [..., out] through the tile copy for a few rows, else the packed copy, else
    `weight`. A weight with tiles is packed too (pack_linears), which gives the out size."""
    if tiles is not None and 0 < x.numel() <= cpu_kernels.tile_rows(amx) * x.shape[-1]:
        out = cpu_kernels.tile_linear(x.reshape(-1, x.shape[-1]), tiles, packed.shape[0], bias, amx)
        return out.view(*x.shape[:-1], out.shape[-1])
    if packed is None:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return packed_linear(x, packed, bias)
    # eagerly the operator itself, without the custom op's Python dispatch
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weight(weight: Tensor) -> Tensor:
    """[out, in] -> the same matrix in oneDNN's blocked layout (a copy)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


class Linear(nn.Linear):
    """nn.Linear that, once packed, multiplies by its oneDNN copy instead of `weight`."""

    packed: Tensor | None = None          # [out, in] in oneDNN's blocked layout, or None
    tiles: Tensor | None = None           # [out/16, in/32, 16, 16, 2] for cpu_kernels, or None
    amx: bool = False                     # the tiles go through AMX (else AVX512-BF16 dot products)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.packed, self.bias, self.tiles, self.amx)


def can_pack(weight: Tensor) -> bool:
    """oneDNN's layout pays only for CPU weights of the dtypes measured (bf16)."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


def pack_linears(module: nn.Module, drop_dense: bool, tiles: bool = False) -> int:
    """Give every `Linear` under `module` (itself included) its packed copy, and with `tiles` its
    tile copy; returns the count. drop_dense releases the plain weight's storage: pass False for
    weights another module also holds (tied embeddings, a drafter sharing the LM head)."""
    count, amx = 0, tiles and cpu_kernels.tiles_available()
    for m in module.modules():
        if not isinstance(m, Linear) or m.packed is not None or not can_pack(m.weight):
            continue
        m.packed = pack_weight(m.weight)
        m.tiles = cpu_kernels.pack_tiles(m.weight) if tiles else None
        m.amx = amx
        if drop_dense:
            m.weight.data = m.weight.data.new_empty(0)
        count += 1
    return count
