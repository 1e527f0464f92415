"""The decoder stack of a small bf16 step as one kernel call per layer, on x86 CPUs with
AVX512-BF16 (projections and scores through AMX tiles where the CPU has them).

A decode or verify step of a few rows spends as long between its projections (some forty small
operators per layer) as in them; decoder_layer_bf16 runs a whole layer in one call, rounding to
bf16 where the modules round (docs/internals.md, "One kernel call per layer"). StepGraphs.run
hands it every step of at most `cpu_kernels.MAX_ROWS` rows (padding included) in one attention
group; the graph backends own the larger steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dspark.kernels import cpu as cpu_kernels
from dspark.models.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from dspark.models.drafter import DraftLayer, Drafter
    from dspark.models.llama import CausalLM, DecoderLayer


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


def _norms_are_bf16(layer) -> bool:
    attn = layer.self_attn
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
    return all(n.weight.dtype == torch.bfloat16 for n in norms if n is not None)


def _layer_weights(layer, qkv: Tensor, qkv_bias: Tensor | None, gate_up: Tensor) -> FusedLayer:
    """A target or draft layer's weights around its (fused or joined) qkv and gate/up tiles."""
    attn = layer.self_attn
    return FusedLayer(
        input_norm=layer.input_layernorm.weight.detach(), qkv=qkv, qkv_bias=qkv_bias,
        q_norm=None if attn.q_norm is None else attn.q_norm.weight.detach(),
        k_norm=None if attn.k_norm is None else attn.k_norm.weight.detach(),
        o=attn.o_proj.tiles, post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=gate_up, down=layer.mlp.down_proj.tiles)


def _fused_layer(layer: "DecoderLayer") -> FusedLayer | None:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(p.tiles is None for p in projections) or not _norms_are_bf16(layer):
        return None
    bias = attn.qkv_proj.bias
    return _layer_weights(layer, attn.qkv_proj.tiles, None if bias is None else bias.detach(),
                          mlp.gate_up_proj.tiles)


def _joined_tiles(projections) -> Tensor | None:
    """The tile copies of projections that share an input, as the one projection of their
    stacked outputs (each output count a whole number of tiles); each projection's own tiles
    become a view of it, so nothing is stored twice. None if any lacks tiles or has a bias."""
    if any(p.tiles is None or p.bias is not None or p.out_features % 16 for p in projections):
        return None
    joined = torch.cat([p.tiles for p in projections])
    first = 0
    for p in projections:
        p.tiles = joined[first: first + p.tiles.shape[0]]
        first += p.tiles.shape[0]
    return joined


def _fused_draft_layer(layer: "DraftLayer") -> FusedLayer | None:
    attn, mlp = layer.self_attn, layer.mlp
    if attn.o_proj.tiles is None or mlp.down_proj.tiles is None or attn.o_proj.bias is not None \
            or not _norms_are_bf16(layer):
        return None
    qkv = _joined_tiles((attn.q_proj, attn.k_proj, attn.v_proj))
    gate_up = _joined_tiles((mlp.gate_proj, mlp.up_proj))
    if qkv is None or gate_up is None:
        return None
    return _layer_weights(layer, qkv, None, gate_up)


class _Fused:
    """Layers for decoder_layer_bf16 and the shapes the kernel takes as arguments."""

    def __init__(self, cfg, layers: list[FusedLayer], amx: bool):
        self.layers = layers
        self.heads, self.intermediate = cfg.num_heads, cfg.intermediate_size
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim ** -0.5
        self.amx = amx                                  # projections and scores through AMX tiles
        # rows a call takes: a layer's projections keep up with oneDNN's to 64 rows either way
        # (a lone wide projection, the LM head, does not without AMX: cpu_kernels.tile_rows)
        self.max_rows = cpu_kernels.MAX_ROWS

    def run_layers(self, x: Tensor, cos: Tensor, sin: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                   slots: Tensor, block_tables: Tensor, keys: Tensor, block_size: int, live: int,
                   block_rows: int = 0, aux_layer_ids: tuple[int, ...] = ()
                   ) -> tuple[Tensor, dict[int, Tensor]]:
        """x [T, hidden] through every layer -> (x, the outputs of the aux layers)."""
        aux = {-1: x} if -1 in aux_layer_ids else {}
        op = torch.ops.dspark_cpu.decoder_layer_bf16
        for i, (w, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            x = op(x, cos, sin, w.input_norm, w.qkv, w.qkv_bias, w.q_norm, w.k_norm, w.o, w.post_norm,
                   w.gate_up, w.down, k_cache, v_cache, slots, block_tables, keys, block_size, live,
                   self.heads, self.intermediate, self.eps, self.scale, block_rows, self.amx)
            if i in aux_layer_ids:
                aux[i] = x
        return x, aux


class FusedStack(_Fused):
    """A packed target's layers for decoder_layer_bf16; `fuse_small_steps` builds it."""

    def takes(self, num_rows: int, meta: AttentionMetadata) -> bool:
        """Whether a step of `num_rows` rows (padding included) runs here."""
        return (0 < num_rows <= self.max_rows and meta.parts is None and meta.token_keys is not None
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
        x, aux = self.run_layers(x, cos, sin, kv_caches, row_slots(meta, live), meta.block_tables,
                                 meta.token_keys[:live], meta.block_size, live, aux_layer_ids=aux_layer_ids)
        return x, torch.cat([aux[i] for i in aux_layer_ids], -1) if aux_layer_ids else None


class FusedDraftStack(_Fused):
    """A packed drafter's layers for decoder_layer_bf16 in block mode; `fuse_draft_blocks`
    builds it. Its block pass reads the context K/V in place from the drafter's pages."""

    def __init__(self, cfg, layers: list[FusedLayer], amx: bool):
        super().__init__(cfg, layers, amx)
        self.q_tiles = cfg.num_heads * cfg.head_dim // 16      # the joined qkv tiles' q part

    def takes(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.max_rows

    def block_forward(self, drafter: "Drafter", block_ids: Tensor, positions: Tensor,
                      kv_caches: list[tuple[Tensor, Tensor]], block_tables: Tensor, starts: Tensor,
                      block_size: int) -> Tensor:
        """`Drafter.block_forward` with the context keys [0, start) of each request read through
        its block table: block_ids/positions [R, S], block_tables [R, NB], starts [R] -> [R, S, d]."""
        r, s = block_ids.shape
        n = r * s
        x = drafter.embed_tokens(block_ids.reshape(-1)).to(drafter.norm.weight.dtype)     # [R*S, d]
        cos, sin = drafter.rotary.cos_sin(positions.reshape(-1), x.dtype)
        keys = torch.stack([torch.arange(r, device=starts.device), torch.zeros_like(starts), starts], 1)
        keys = keys.repeat_interleave(s, 0)                                               # [R*S, 3]
        no_slots = torch.zeros(0, dtype=torch.long)
        x, _ = self.run_layers(x, cos.view(n, -1), sin.view(n, -1), kv_caches, no_slots,
                               block_tables.long(), keys, block_size, n, block_rows=s)
        return drafter.norm(x).view(r, s, -1)

    def append_context(self, drafter: "Drafter", kv_caches: list[tuple[Tensor, Tensor]], aux_hidden: Tensor,
                       positions: Tensor, write_rows: Tensor | None, write_slots: Tensor) -> None:
        """`draft.append_context` for at most `max_rows` rows: each layer's context K/V in one
        kernel call (the joined k/v projection, k norm, rotary, the slot writes)."""
        h = drafter.project_context(aux_hidden)                                          # [T, d]
        t = h.shape[0]
        cos, sin = drafter.rotary.cos_sin(positions, h.dtype)
        slots = slots_per_row(write_rows, write_slots, t)
        op = torch.ops.dspark_cpu.context_kv_bf16
        for w, (k_cache, v_cache) in zip(self.layers, kv_caches):
            op(h, cos.view(t, -1), sin.view(t, -1), w.qkv[self.q_tiles:], w.k_norm, k_cache, v_cache, slots,
               self.eps, self.amx)

    def markov_greedy(self, drafter: "Drafter", h: Tensor, base: Tensor, anchors: Tensor
                      ) -> tuple[Tensor, Tensor] | None:
        """The γ greedy drafts of a vanilla Markov head in one call (cpu_kernels'
        markov_greedy_bf16): h [R, γ, d], base fp32 [R, γ, V_draft], anchors [R] -> (target ids
        [R, γ], confidence logits fp32 [R, γ], zeros without a head); None where it cannot run
        (another head type, a confidence head without the Markov input, more than `max_rows`
        requests)."""
        cfg, head, conf = drafter.config, drafter.markov_head, drafter.confidence_head
        if head is None or head.head_type != "vanilla" or head.markov_w2.tiles is None \
                or not 0 < h.shape[0] <= self.max_rows or h.dtype != torch.bfloat16:
            return None
        if conf is not None and (not cfg.confidence_head_with_markov or conf.proj.tiles is None):
            return None
        return torch.ops.dspark_cpu.markov_greedy_bf16(
            base, h, anchors, head.markov_w1.weight, head.markov_w2.tiles,
            None if conf is None else conf.proj.tiles, None if conf is None else conf.proj.bias,
            drafter.draft_to_target_index if cfg.uses_draft_vocab else None, self.amx)


def slots_per_row(write_rows: Tensor | None, write_slots: Tensor, rows: int) -> Tensor:
    """[rows] the cache slot each row's K/V goes to, -1 for rows that store none, from the
    metadata's (write_rows, write_slots) form (write_rows None: every row, in order)."""
    if write_rows is None:
        if write_slots.shape[0] != rows:
            raise ValueError(f"{write_slots.shape[0]} write slots for {rows} rows")
        return write_slots
    return torch.full((rows,), -1, dtype=torch.long).index_copy_(0, write_rows, write_slots)


def row_slots(meta: AttentionMetadata, live: int) -> Tensor:
    """[live] the cache slot of each live row of a step."""
    return slots_per_row(meta.write_rows, meta.write_slots, live)


def fuse_draft_blocks(drafter: "Drafter") -> "FusedDraftStack | None":
    """A packed bf16 drafter's FusedDraftStack where the kernels run and its projections qualify
    (tile copies, no biases); None otherwise."""
    return _fused(drafter, drafter.layers, _fused_draft_layer, FusedDraftStack)


def fuse_small_steps(model: "CausalLM") -> "FusedStack | None":
    """A packed bf16 target's FusedStack where the kernels run: every projection has its tile
    copy (pack_for_inference on an AVX512-BF16 CPU) and the norms are bf16; None otherwise."""
    return _fused(model, model.layers, _fused_layer, FusedStack)


def _fused(module, layers, fuse_layer, stack):
    """`stack` over every layer fused, or None: off the CPU (no x86 kernel is built there),
    without the kernels, past their head limits, or with a layer that does not qualify."""
    cfg = module.config
    on_cpu = next(module.parameters()).device.type == "cpu"
    if not on_cpu or not cpu_kernels.available() or cfg.num_heads // cfg.num_kv_heads > cpu_kernels.MAX_GROUP \
            or cfg.head_dim > cpu_kernels.MAX_HEAD_DIM:
        return None
    fused = [fuse_layer(layer) for layer in layers]
    if any(layer is None for layer in fused):
        return None
    return stack(cfg, fused, layers[0].mlp.down_proj.amx)   # as packed


__all__ = ["FusedDraftStack", "FusedLayer", "FusedStack", "fuse_draft_blocks", "fuse_small_steps", "row_slots",
           "slots_per_row"]
