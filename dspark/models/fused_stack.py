"""The decoder stack of a small bf16 step as one kernel call per layer, on x86 CPUs with AMX.

A decode or verify step of a few rows spends as long between its projections as in them: the
norms, the rotary embedding, the K/V write and the residual adds are some forty small operators
per layer, a few microseconds of dispatch each, and torch.compile trades them for guard checks
and a wrapper call per compiled piece. `cpu_kernels`' decoder_layer_bf16 runs a whole layer
(norms, AMX projections, rotary, K/V write, paged attention, SiLU gate) in one call, rounding
to bf16 where the modules round. `CausalLM.run_stack` hands it every step it can take: at most
`cpu_kernels.MAX_ROWS` rows (bucket padding included), attention by the in-place kernel, one
attention group. The graph backends still own the larger steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dspark.models.layers import cpu_kernels
from dspark.models.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from dspark.models.llama import CausalLM, DecoderLayer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's weights as the kernel reads them (projections tile by tile)."""
    input_norm: Tensor            # [hidden] bf16
    qkv: Tensor                   # tiles of [H*D + 2*KVH*D, hidden]
    qkv_bias: Tensor | None       # [H*D + 2*KVH*D] bf16 (Qwen2)
    q_norm: Tensor | None         # [D] bf16 (Qwen3)
    k_norm: Tensor | None         # [D] bf16
    o: Tensor                     # tiles of [hidden, H*D]
    post_norm: Tensor             # [hidden] bf16
    gate_up: Tensor               # tiles of [2*I, hidden]
    down: Tensor                  # tiles of [hidden, I]


def _fused_layer(layer: "DecoderLayer") -> FusedLayer | None:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    norms += [n.weight for n in (attn.q_norm, attn.k_norm) if n is not None]
    if any(p.tiles is None for p in projections) or any(w.dtype != torch.bfloat16 for w in norms):
        return None
    bias = attn.qkv_proj.bias
    return FusedLayer(
        input_norm=layer.input_layernorm.weight.detach(), qkv=attn.qkv_proj.tiles,
        qkv_bias=None if bias is None else bias.detach(),
        q_norm=None if attn.q_norm is None else attn.q_norm.weight.detach(),
        k_norm=None if attn.k_norm is None else attn.k_norm.weight.detach(),
        o=attn.o_proj.tiles, post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=mlp.gate_up_proj.tiles, down=mlp.down_proj.tiles)


class FusedStack:
    """A packed target's layers for decoder_layer_bf16; `fuse_small_steps` builds it."""

    def __init__(self, model: "CausalLM", layers: list[FusedLayer]):
        cfg = model.config
        self.layers = layers
        self.heads, self.intermediate = cfg.num_heads, cfg.intermediate_size
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim ** -0.5
        self.group = cfg.num_heads // cfg.num_kv_heads

    def takes(self, num_rows: int, meta: AttentionMetadata) -> bool:
        """Whether a step of `num_rows` rows (padding included) runs here."""
        return (0 < num_rows <= cpu_kernels.MAX_ROWS and meta.parts is None and meta.token_keys is not None
                and (meta.num_tokens is None or meta.num_tokens > 0) and meta.max_q <= cpu_kernels.MAX_QUERY)

    def run(self, model: "CausalLM", input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
            kv_caches: list[tuple[Tensor, Tensor]], aux_layer_ids: tuple[int, ...]
            ) -> tuple[Tensor, Tensor | None]:
        """[T] tokens -> last hidden [T, hidden] and aux hidden, as `CausalLM.run_stack`."""
        t = input_ids.shape[0]
        live = t if meta.num_tokens is None else meta.num_tokens
        x = model.embed_tokens(input_ids)                                      # [T, hidden]
        cos, sin = model.rotary.cos_sin(positions, x.dtype)                    # [T, 1, D]
        cos, sin = cos.view(t, -1), sin.view(t, -1)
        slots = row_slots(meta, live)
        keys, tables = meta.token_keys[:live], meta.block_tables
        aux = {-1: x} if -1 in aux_layer_ids else {}
        op = torch.ops.dspark_cpu.decoder_layer_bf16
        for i, (w, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            x = op(x, cos, sin, w.input_norm, w.qkv, w.qkv_bias, w.q_norm, w.k_norm, w.o, w.post_norm,
                   w.gate_up, w.down, k_cache, v_cache, slots, tables, keys, meta.block_size, live,
                   self.heads, self.intermediate, self.eps, self.scale)
            if i in aux_layer_ids:
                aux[i] = x
        return x, torch.cat([aux[i] for i in aux_layer_ids], -1) if aux_layer_ids else None


def row_slots(meta: AttentionMetadata, live: int) -> Tensor:
    """[live] the cache slot each live row's K/V goes to, -1 for rows that store none."""
    if meta.write_rows is None:
        if meta.write_slots.shape[0] != live:
            raise ValueError(f"{meta.write_slots.shape[0]} write slots for {live} live rows")
        return meta.write_slots
    slots = torch.full((live,), -1, dtype=torch.long)
    return slots.index_copy_(0, meta.write_rows, meta.write_slots)


def fuse_small_steps(model: "CausalLM") -> bool:
    """Give a packed bf16 target its FusedStack (model.fused_stack) where the kernels run: every
    projection has its tile copy (pack_for_inference on an AMX CPU) and the norms are bf16.
    -> whether it did."""
    if not cpu_kernels.tiles_available() or model.config.num_heads // model.config.num_kv_heads > cpu_kernels.MAX_GROUP:
        return False
    layers = [_fused_layer(layer) for layer in model.layers]
    if any(layer is None for layer in layers):
        return False
    model.fused_stack = FusedStack(model, layers)
    logger.info("steps of up to %d rows run each decoder layer as one kernel call", cpu_kernels.MAX_ROWS)
    return True


__all__ = ["FusedLayer", "FusedStack", "fuse_small_steps", "row_slots"]
