"""The decoder-only target: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm),
which differ only in flags of ModelConfig. Q/K/V and gate/up are fused: a small step is a chain of
small matmuls, and every launch counts.
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
    """What passes from one piece of the stack (everything between two attention calls) to the
    next; a captured graph keeps these tensors at fixed addresses (docs/graphs.md)."""
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
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
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
        """Residual x [T, hidden] -> this layer's q, k, v."""
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual x [T, hidden] and attention output [T, H*D] -> the layer's output [T, hidden]."""
        x = x + self.self_attn.o_proj(attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def layer_transition(layer: DecoderLayer, next_layer: DecoderLayer | None, x: torch.Tensor,
                     attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Between two attention calls: `layer`'s output [T, hidden] from its residual and attention
    output [T, H*D], then `next_layer`'s q, k, v (None after the last). Layers are arguments, so
    one compiled graph serves every layer."""
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
        """input_ids/positions [T]; logits only for rows logits_indices [N]. aux_layer_ids count
        decoder-layer outputs (i = layer i, -1 = embeddings: DeepSpec's count), concatenated in order."""
        x, aux_hidden = self.run_stack(input_ids, positions, meta, kv_caches, aux_layer_ids)
        return self.compute_logits(x, logits_indices, aux_hidden)

    def run_stack(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  kv_caches: list[tuple[torch.Tensor, torch.Tensor]], aux_layer_ids: tuple[int, ...] = (),
                  entry: Callable | None = None, transition: Callable | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T] tokens -> last hidden [T, hidden] and aux hidden: the pieces a graph bucket compiles or
        captures (docs/graphs.md) with eager attention between them; `entry` (`embed_and_enter`)
        and `transition` (`layer_transition`) may be compiled versions of themselves."""
        s = self.first_piece(input_ids, positions, aux_layer_ids, entry)
        for i, layer in enumerate(self.layers):
            attn = attend(s.q, s.k, s.v, kv_caches[i], meta, layer.self_attn.scale)   # [T, H*D]
            s = self.layer_piece(i, s, attn, aux_layer_ids, transition)
        return s.x, self.aux_hidden(s, aux_layer_ids)

    def embed_and_enter(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Piece 0: embeddings [T, hidden], the step's rotary tables and layer 0's q, k, v."""
        x = self.embed_tokens(input_ids)                          # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return (x, cos, sin, *self.layers[0].pre_attention(x, cos, sin))

    def first_piece(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    aux_layer_ids: tuple[int, ...] = (), entry: Callable | None = None) -> StackState:
        """Piece 0 as the state a captured graph keeps."""
        x, cos, sin, q, k, v = (entry or self.embed_and_enter)(input_ids, positions)
        return StackState(x, cos, sin, q, k, v, {-1: x} if -1 in aux_layer_ids else {})

    def layer_piece(self, i: int, s: StackState, attn: torch.Tensor, aux_layer_ids: tuple[int, ...] = (),
                    transition: Callable | None = None) -> StackState:
        """Piece i+1: layer i after its attention with the next layer's pre-attention (after the
        last layer, only the residual stream)."""
        nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
        x, q, k, v = (transition or layer_transition)(self.layers[i], nxt, s.x, attn, s.cos, s.sin)
        aux = {**s.aux, i: x} if i in aux_layer_ids else s.aux
        return StackState(x, s.cos, s.sin, q, k, v, aux)

    @staticmethod
    def aux_hidden(s: StackState, aux_layer_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The aux features of the whole stack, [T, len(aux_layer_ids) * hidden], in the order given."""
        return torch.cat([s.aux[i] for i in aux_layer_ids], -1) if aux_layer_ids else None

    def compute_logits(self, x: torch.Tensor, logits_indices: torch.Tensor,
                       aux_hidden: torch.Tensor | None) -> ModelOutput:
        """x [T, hidden] -> fp32 logits of rows logits_indices [N] (a count that varies within a
        bucket, so this tail stays outside the graph)."""
        h = self.norm(x.index_select(0, logits_indices))          # [N, hidden]
        return ModelOutput(logits=self.lm_head(h).float(), aux_hidden=aux_hidden)

    def load_weights(self, weights) -> None:
        """Load Hugging Face named tensors, fusing q/k/v and gate/up as they arrive."""
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        # Hugging Face projection -> (fused parameter, shard, first row, rows)
        fused = {"q_proj": ("qkv_proj", 0, 0, q), "k_proj": ("qkv_proj", 1, q, kv),
                 "v_proj": ("qkv_proj", 2, q + kv, kv),
                 "gate_proj": ("gate_up_proj", 0, 0, inter), "up_proj": ("gate_up_proj", 1, inter, inter)}
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            parts = name.split(".")
            target, shard = name, None
            if len(parts) >= 2 and parts[-2] in fused:
                fused_name, shard, start, rows = fused[parts[-2]]
                target = ".".join(parts[:-2] + [fused_name, parts[-1]])
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            with torch.no_grad():
                dst = params[target] if shard is None else params[target].narrow(0, start, rows)
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight shape {tuple(tensor.shape)} does not match {tuple(dst.shape)}")
                dst.copy_(tensor)                   # converts in the same pass
            loaded.add(name)
        # fail at load time, not at the first forward, naming weights as the checkpoint does: a
        # fused parameter by each projection it holds
        projections = {f: [p for p, (g, *_) in fused.items() if g == f] for f, *_ in fused.values()}
        expected = []
        for name in params:           # a tied lm_head.weight is not listed: it is embed_tokens.weight
            module = name.split(".")[-2]
            expected += ([name.replace(f".{module}.", f".{p}.") for p in projections[module]]
                         if module in projections else [name])
        missing = [name for name in expected if name not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")
