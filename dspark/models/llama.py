"""The decoder-only target: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

The families differ only in a few flags of ModelConfig, so one module serves all of them.  Q/K/V
and gate/up are stored fused (one matmul each) because at batch 1 on a CPU the step is a chain of
small GEMVs and every launch counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.layers.linear import Linear
from dspark.models.layers.attention import AttentionMetadata, attend
from dspark.models.layers.norm import RMSNorm
from dspark.models.layers.rotary import RotaryEmbedding, apply_rotary
from dspark.models.model_config import ModelConfig


@dataclass
class ModelOutput:
    logits: torch.Tensor                 # [N, V] fp32, rows picked by logits_indices
    aux_hidden: torch.Tensor | None      # [T, len(aux_layer_ids) * hidden] or None


@dataclass
class StackState:
    """What passes from one piece of the decoder stack to the next (see CausalLM.forward_hidden).

    A piece is everything between two attention calls; a captured graph keeps these tensors at
    fixed addresses, so the next piece reads them in place.
    """
    x: torch.Tensor                      # [T, hidden] residual stream
    cos: torch.Tensor                    # [T, 1, D] rotary tables of the step's positions
    sin: torch.Tensor                    # [T, 1, D]
    q: torch.Tensor | None               # [T, H, D] next layer's attention input (None after the last)
    k: torch.Tensor | None               # [T, KVH, D]
    v: torch.Tensor | None               # [T, KVH, D]
    aux: dict[int, torch.Tensor]         # aux layer id -> [T, hidden], those collected so far


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H, D], k/v [T, KVH, D], rotated and normed: what `attend` takes."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual x [T, hidden] -> this layer's q, k, v (input norm, projection, q/k norm, rotary)."""
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual x [T, hidden] and attention output [T, H*D] -> the layer's output [T, hidden]."""
        x = x + self.self_attn.o_proj(attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def layer_transition(layer: DecoderLayer, next_layer: DecoderLayer | None, x: torch.Tensor,
                     attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Everything between two attention calls: layer's output [T, hidden] from its residual and
    attention output [T, H*D], then next_layer's q, k, v (None after the last layer). The layers
    are arguments, not indices, so one compiled graph serves every layer of a bucket."""
    x = layer.post_attention(x, attn)
    if next_layer is None:
        return x, None, None, None
    return (x, *next_layer.pre_attention(x, cos, sin))


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
                aux_layer_ids: tuple[int, ...] = ()) -> ModelOutput:
        """input_ids/positions [T]; logits only for rows logits_indices [N].

        aux_layer_ids count decoder-layer outputs (id i = output of layer i, -1 = the embeddings),
        the DeepSpec convention; the aux hidden concatenates them in the order given.
        """
        x, aux_hidden = self.forward_hidden(input_ids, positions, meta, kv_caches, aux_layer_ids)
        return self.compute_logits(x, logits_indices, aux_hidden)

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder stack: [T] tokens -> last hidden [T, hidden] and aux hidden. Its shapes are
        the step's token count alone, so a graph bucket compiles or captures exactly this.

        It runs as pieces with attention between them: piece 0 (`first_piece`) and then one
        `layer_piece` per layer. Attention is the only part whose shapes follow the context, so
        a CUDA-graph bucket captures each piece and calls `attend` eagerly in between
        (runner/backends.py); this loop is that replay loop with the pieces run directly.
        """
        return self.run_stack(input_ids, positions, meta, kv_caches, aux_layer_ids)

    def run_stack(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  kv_caches: list[tuple[torch.Tensor, torch.Tensor]], aux_layer_ids: tuple[int, ...] = (),
                  entry: Callable | None = None, transition: Callable | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stack as pieces with eager attention between them; `entry` (`embed_and_enter`) and
        `transition` (`layer_transition`) may be swapped for compiled versions of themselves."""
        entry = entry or self.embed_and_enter
        transition = transition or layer_transition
        x, cos, sin, q, k, v = entry(input_ids, positions)
        aux = {-1: x} if -1 in aux_layer_ids else {}
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = attend(q, k, v, kv_caches[i], meta, layer.self_attn.scale)   # [T, H*D]
            x, q, k, v = transition(layer, self.layers[i + 1] if i < last else None, x, attn, cos, sin)
            if i in aux_layer_ids:
                aux[i] = x
        return x, torch.cat([aux[i] for i in aux_layer_ids], -1) if aux_layer_ids else None

    def embed_and_enter(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Piece 0: embeddings [T, hidden], the step's rotary tables and layer 0's q, k, v."""
        x = self.embed_tokens(input_ids)                          # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return (x, cos, sin, *self.layers[0].pre_attention(x, cos, sin))

    def first_piece(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    aux_layer_ids: tuple[int, ...] = ()) -> StackState:
        """Piece 0 as the state a captured graph keeps (CUDA graphs)."""
        x, cos, sin, q, k, v = self.embed_and_enter(input_ids, positions)
        return StackState(x, cos, sin, q, k, v, {-1: x} if -1 in aux_layer_ids else {})

    def layer_piece(self, i: int, s: StackState, attn: torch.Tensor,
                    aux_layer_ids: tuple[int, ...] = ()) -> StackState:
        """Piece i+1 as a captured graph's state: layer i after its attention, fused with the next
        layer's pre-attention; after the last layer only the residual stream remains."""
        nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
        x, q, k, v = layer_transition(self.layers[i], nxt, s.x, attn, s.cos, s.sin)
        aux = {**s.aux, i: x} if i in aux_layer_ids else s.aux
        return StackState(x, s.cos, s.sin, q, k, v, aux)

    @staticmethod
    def aux_hidden(s: StackState, aux_layer_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The aux features of the whole stack, [T, len(aux_layer_ids) * hidden], in the order given."""
        return torch.cat([s.aux[i] for i in aux_layer_ids], -1) if aux_layer_ids else None

    def compute_logits(self, x: torch.Tensor, logits_indices: torch.Tensor,
                       aux_hidden: torch.Tensor | None) -> ModelOutput:
        """x [T, hidden] -> fp32 logits of the rows logits_indices [N] (their count varies within
        a bucket, so this tail stays outside the graph)."""
        h = self.norm(x.index_select(0, logits_indices))          # [N, hidden]
        logits = self.lm_head(h).float()                           # [N, V]
        return ModelOutput(logits=logits, aux_hidden=aux_hidden)

    def load_weights(self, weights) -> None:
        """Load Hugging Face named tensors, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            parts = name.split(".")
            target, shard = name, None
            if len(parts) >= 2 and parts[-2] in fused:
                fused_name, shard = fused[parts[-2]]
                target = ".".join(parts[:-2] + [fused_name, parts[-1]])
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
            _copy_shard(params[target], tensor, shard, self._shard_sizes(parts[-2] if shard is not None else ""))
            loaded.add(target if shard is None else f"{target}#{shard}")
        self._check_complete(params, loaded)

    def _shard_sizes(self, proj: str) -> list[int]:
        cfg = self.config
        if proj in ("q_proj", "k_proj", "v_proj"):
            return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        return [cfg.intermediate_size] * 2

    def _check_complete(self, params: dict, loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight")):
                n = 2 if "gate_up" in name else 3
                missing += [f"{name}#{i}" for i in range(n) if f"{name}#{i}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: int | None, sizes: list[int]) -> None:
    with torch.no_grad():
        if shard is None:
            dst = param
        else:
            start = sum(sizes[:shard])
            dst = param.narrow(0, start, sizes[shard])
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"weight shape {tuple(tensor.shape)} does not match {tuple(dst.shape)}")
        dst.copy_(tensor.to(dst.dtype))
