"""The projection layer every module uses, and its inference layout on CPUs.

A CPU decode step is a chain of few-row products, paced by how fast the weights stream. oneDNN
streams a bf16 weight faster in its own blocked layout (same kernel, bit-identical results), and
dspark's kernel (`cpu_kernels`) faster still at a few rows from its tile-by-tile copy
(docs/internals.md). `pack_linears` converts an inference model once after loading; training
never packs, because a packed copy does not follow updates to the weight.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark.kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)


@torch.library.custom_op("dspark::packed_linear", mutates_args=())
def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., in] @ packed [out, in] (oneDNN layout) -> [..., out]. A custom op, so torch.compile
    calls it as one kernel instead of lowering an operator that expects a frozen constant."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


@functools.cache
def lower_packed_linear() -> None:
    """Have inductor call oneDNN's operator directly where a compiled graph uses `packed_linear`,
    not through the custom op's Python wrapper, paid once per projection. (Inductor's own lowering
    of `_linear_pointwise` wants a frozen constant weight.) Once per process, before compiling."""
    from torch._inductor.lowering import fallback_handler, register_lowering

    call = fallback_handler(torch.ops.mkldnn._linear_pointwise.default, add_to_fallback_set=False)

    @register_lowering(torch.ops.dspark.packed_linear.default, type_promotion_kind=None)
    def _lowered(x, packed, bias):
        return call(x, packed, bias, "none", [], "")


def linear(x: Tensor, weight: Tensor, packed: Tensor | None, bias: Tensor | None = None,
           tiles: Tensor | None = None, amx: bool = False) -> Tensor:
    """x [..., in] -> [..., out]: through the tile copy of `weight` (cpu_kernels.pack_tiles) when
    there is one and x has at most cpu_kernels.tile_rows(amx) rows, else through the packed copy
    when there is one. A weight with tiles is packed too (pack_linears), which gives the out size."""
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

    def weight_bytes(self) -> int:
        """Bytes one forward reads from the weight, whichever copy it uses."""
        return self.in_features * self.out_features * self.weight.element_size()


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


def pack_for_inference(target: nn.Module, drafter: nn.Module | None) -> int:
    """Pack an engine's target and drafter. The target's LM head keeps its plain weight: it may
    be tied to the embeddings, and a drafter derives its reduced-vocabulary head from it."""
    tiles = can_pack(target.lm_head.weight) and cpu_kernels.available()
    amx = tiles and cpu_kernels.tiles_available()
    count = sum(pack_linears(layer, drop_dense=True, tiles=tiles) for layer in target.layers)
    count += pack_linears(target.lm_head, drop_dense=False, tiles=tiles)
    if drafter is not None:
        count += pack_linears(drafter, drop_dense=True, tiles=tiles)
        head = getattr(drafter, "draft_lm_head_weight", None)
        if head is not None and head.numel() and can_pack(head):
            drafter.draft_lm_head_packed = pack_weight(head)     # its reduced-vocabulary head
            drafter.draft_lm_head_tiles = cpu_kernels.pack_tiles(head) if tiles else None
            drafter.draft_lm_head_amx = amx
            count += 1
    if count:
        logger.info("packed %d projection weights in oneDNN's layout%s", count,
                    f", and tile by tile for steps of up to {cpu_kernels.tile_rows(amx)} rows" if tiles else "")
    return count

