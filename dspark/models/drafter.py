"""The DSpark drafter: a block-parallel backbone conditioned on target features, a low-rank
sequential (Markov) head and a confidence head (reference/dspark_algorithm.md §3).

The token embedding and LM head are the target's, shared and kept out of `state_dict()`. Context
K/V are computed once per committed token (`context_kv`) and cached by the caller, so a draft step
(`block_forward`) runs only the block slots. The drafter holds weights; state comes as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.layers.linear import Linear, linear
from dspark.models.layers.norm import RMSNorm
from dspark.models.layers.rotary import RotaryEmbedding, apply_rotary
from dspark.models.llama import DecoderLayer

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DrafterConfig:
    block_size: int                     # γ: draft tokens per block (always drafted in full)
    target_layer_ids: tuple[int, ...]   # DeepSpec ids: i = output of target layer i, -1 = embeddings
    sample_from_anchor: bool            # True: slots [x0, MASK*(γ-1)] give γ drafts; False: 1+γ slots
    mask_token_id: int
    markov_rank: int                    # 0 = no sequential head (plain DFlash)
    markov_head_type: str               # vanilla | gated | rnn
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qk_norm: bool
    attention_bias: bool
    target_hidden_size: int
    vocab_size: int                     # target vocabulary
    draft_vocab_size: int               # == vocab_size unless a reduced draft vocabulary is used
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_rank > 0 and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"unknown markov_head_type {self.markov_head_type!r}; "
                             f"expected one of {list(MARKOV_HEAD_TYPES)}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError("confidence_head_with_markov=True needs a Markov head, "
                             "but markov_rank is 0")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in "
                             f"[1, vocab_size={self.vocab_size}]")

    @property
    def num_block_slots(self) -> int:
        """Query rows per block: the anchor plus γ-1 masks, or plus γ masks in the DFlash layout."""
        return self.block_size if self.sample_from_anchor else self.block_size + 1

    @property
    def uses_draft_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size


class DraftAttention(nn.Module):
    """Non-causal attention over [cached context K/V ; own block]; context enters k/v_proj
    without the layer's input norm (it was normalised once by `hidden_norm`)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d, q_size, kv_size = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(d, q_size, bias=cfg.attention_bias)
        self.k_proj = Linear(d, kv_size, bias=cfg.attention_bias)
        self.v_proj = Linear(d, kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, d, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., d] -> roped k, v [..., KVH, D] (same path for context and block rows)."""
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rotary(k, cos, sin), v

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [R, S, d] (normed), cos/sin [R, S, 1, D] -> q [R, S, H, D], block k, v [R, S, KVH, D]."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))       # [R, S, H, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
        return (apply_rotary(q, cos, sin), *self.keys_values(x, cos, sin))

    def attend(self, q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, ctx_k: torch.Tensor,
               ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [R, S, H, D], k/v_blk [R, S, KVH, D], ctx_k/ctx_v [R, L, KVH, D], mask [R, 1, 1, L+S]
        -> [R, S, H*D], before o_proj (the one part whose shapes follow the context length L)."""
        k = torch.cat([ctx_k.to(k_blk.dtype), k_blk], dim=1).transpose(1, 2)     # [R, KVH, L+S, D]
        v = torch.cat([ctx_v.to(v_blk.dtype), v_blk], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).flatten(-2)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self.self_attn.pre_attention(self.input_layernorm(x), cos, sin)

    post_attention = DecoderLayer.post_attention      # x [R, S, d], attn [R, S, H*D] -> [R, S, d]


class BlockState(NamedTuple):
    """The block pass between two attention calls: what a captured piece keeps
    (runner/draft_pieces.py)."""
    x: torch.Tensor                 # [R, S, d] residual stream (after the last layer: final-normed)
    cos: torch.Tensor               # [R, S, 1, D]
    sin: torch.Tensor               # [R, S, 1, D]
    q: torch.Tensor | None          # [R, S, H, D] the next layer's (None after the last layer)
    k: torch.Tensor | None          # [R, S, KVH, D] its block keys, roped
    v: torch.Tensor | None          # [R, S, KVH, D]


class MarkovHead(nn.Module):
    """W1 is indexed by target ids (the previous token); W2 projects to the draft vocabulary."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        r, d = cfg.markov_rank, cfg.hidden_size
        self.head_type = cfg.markov_head_type
        self.markov_w1 = nn.Embedding(cfg.vocab_size, r)
        self.markov_w2 = Linear(r, cfg.draft_vocab_size, bias=False)
        if self.head_type == "gated":
            self.gate_proj = Linear(d + r, r, bias=True)
        elif self.head_type == "rnn":
            self.joint_proj = Linear(2 * r + d, 3 * r, bias=True)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = Linear(input_dim, 1, bias=True)


class Drafter(nn.Module):
    draft_lm_head_packed: torch.Tensor | None = None   # [V_draft, d] oneDNN copy (inference only)
    draft_lm_head_tiles: torch.Tensor | None = None    # its cpu_kernels tile copy (inference only)
    draft_lm_head_amx: bool = False                      # the tiles go through AMX

    def __init__(self, cfg: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Module):
        super().__init__()
        self.config = cfg
        # a tuple is not registered: the target's modules stay out of state_dict(), .to() and
        # parameters(), so they are shared with the target and never copied or saved twice
        self._shared = (embed_tokens, lm_head)
        d = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings + cfg.num_block_slots,
                                      cfg.rope_theta, cfg.rope_scaling)
        self.markov_head = MarkovHead(cfg) if cfg.markov_rank > 0 else None
        extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
        self.confidence_head = ConfidenceHead(d + extra) if cfg.enable_confidence_head else None
        if cfg.uses_draft_vocab:
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
            # derived at load from the target lm_head and d2t; never saved
            self.register_buffer("draft_lm_head_weight", torch.empty(0), persistent=False)
            self.register_buffer("draft_to_target_index", torch.empty(0, dtype=torch.long),
                                 persistent=False)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared[1]

    # ---- context ---------------------------------------------------------------------------

    def project_context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[N, m*d_t] target features of committed tokens -> [N, d]."""
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def context_kv(self, h_ctx: torch.Tensor,
                   positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """h_ctx [N, d], positions [N] -> per draft layer (k, v), each [N, KVH, D], k roped."""
        cos, sin = self.rotary.cos_sin(positions, h_ctx.dtype)
        return [layer.self_attn.keys_values(h_ctx, cos, sin) for layer in self.layers]

    # ---- block -----------------------------------------------------------------------------

    def block_forward(self, block_ids: torch.Tensor, positions: torch.Tensor,
                      ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor],
                      ctx_valid: torch.Tensor) -> torch.Tensor:
        """One bidirectional pass over every request's block: block_ids/positions [R, S]
        (S = num_block_slots, positions = anchor_pos + slot), ctx_k/ctx_v per layer [R, L, KVH, D],
        ctx_valid [R, L] (keys before the anchor) -> final-normed block hidden [R, S, d]. The
        pieces are those a CUDA-graph bucket captures (runner/draft_pieces.py)."""
        s = self.block_enter(block_ids, positions)
        mask = block_mask(ctx_valid, block_ids.shape[1])
        for i in range(len(self.layers)):
            s = self.block_transition(i, s, self.block_attention(i, s, ctx_k[i], ctx_v[i], mask))
        return s.x

    def block_enter(self, block_ids: torch.Tensor, positions: torch.Tensor) -> BlockState:
        """Piece 0: the block's embeddings, rotary tables and layer 0's q, k, v."""
        r, s = block_ids.shape
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)               # [R, S, d]
        cos, sin = self.rotary.cos_sin(positions.reshape(-1), x.dtype)
        cos, sin = cos.view(r, s, 1, -1), sin.view(r, s, 1, -1)                # [R, S, 1, D]
        return BlockState(x, cos, sin, *self.layers[0].pre_attention(x, cos, sin))

    def block_attention(self, i: int, s: BlockState, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
        """Layer i's attention over [context ; block] -> [R, S, H*D]."""
        return self.layers[i].self_attn.attend(s.q, s.k, s.v, ctx_k, ctx_v, mask)

    def block_transition(self, i: int, s: BlockState, attn: torch.Tensor) -> BlockState:
        """Piece i+1: layer i after its attention, with the next layer's q, k, v (or, after the
        last layer, the final norm)."""
        x = self.layers[i].post_attention(s.x, attn)
        if i + 1 < len(self.layers):
            return BlockState(x, s.cos, s.sin, *self.layers[i + 1].pre_attention(x, s.cos, s.sin))
        return BlockState(self.norm(x), s.cos, s.sin, None, None, None)

    def draft_hidden(self, h_block: torch.Tensor) -> torch.Tensor:
        """[R, S, d] -> [R, γ, d]: the rows whose logits are the γ drafts."""
        off = self.config.num_block_slots - self.config.block_size     # 1 in the DFlash layout
        return h_block[:, off:off + self.config.block_size]

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., d] -> fp32 [..., V_draft] through the target lm_head (its draft-vocab rows)."""
        if self.config.uses_draft_vocab:
            return linear(h, self.draft_lm_head_weight.to(h.dtype), self.draft_lm_head_packed,
                          tiles=self.draft_lm_head_tiles, amx=self.draft_lm_head_amx).float()
        return self.lm_head(h.to(self.lm_head.weight.dtype)).float()

    # ---- sequential head -------------------------------------------------------------------

    def markov_embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """[R] previous tokens (target ids) -> e [R, r] = W1[prev]."""
        return self.markov_head.markov_w1(prev_ids.long())

    def init_markov_state(self, h_block: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor | None:
        """Recurrent state entering draft 1 (None unless the head is `rnn`). In the DFlash layout
        the reference also runs the recurrence over the anchor row (fed the anchor and h_0), though
        its draft is never used, so draft 1's state has absorbed that step."""
        head = self.markov_head
        if head is None or head.head_type != "rnn":
            return None
        state = h_block.new_zeros(h_block.shape[0], self.config.markov_rank)
        if not self.config.sample_from_anchor:
            _, state = self.markov_bias(self.markov_embed(anchor_ids), h_block[:, 0], state)
        return state

    def markov_bias(self, e: torch.Tensor, h_k: torch.Tensor,
                    state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """e [R, r], h_k [R, d] -> (fp32 bias B_k [R, V_draft], next state)."""
        head = self.markov_head
        if head.head_type == "vanilla":
            return head.markov_w2(e).float(), state
        h_k = h_k.to(e.dtype)
        if head.head_type == "gated":
            gate = torch.sigmoid(head.gate_proj(torch.cat([h_k, e], dim=-1)))
            return head.markov_w2(gate * e).float(), state
        # rnn: joint_proj([s_{k-1}; e; h_k]) chunked into gate, candidate, output
        gate_raw, cand_raw, out_raw = head.joint_proj(torch.cat([state, e, h_k], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return head.markov_w2(torch.tanh(out_raw)).float(), state

    def confidence_logits(self, h_k: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        """h_k [R, d] (post final norm), e [R, r] -> fp32 logit z_k [R]; c_k = sigmoid(z_k)."""
        feats = h_k
        if self.config.confidence_head_with_markov:
            feats = torch.cat([h_k, e.to(h_k.dtype)], dim=-1)
        return self.confidence_head.proj(feats).squeeze(-1).float()

    # ---- vocabulary --------------------------------------------------------------------------

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids. The draft ids list their target ids in increasing
        order, so the first maximum over the draft vocabulary is the first over the scattered
        target-vocabulary logits: greedy drafting can take its argmax over V_draft."""
        return self.draft_to_target_index[draft_ids] if self.config.uses_draft_vocab else draft_ids

    # ---- weights -----------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Strict load of drafter weights (names as speculators and DeepSpec save them)."""
        own = self.state_dict()
        unexpected, misshaped, loaded = [], [], set()
        for name, tensor in named_tensors:
            if name not in own:
                unexpected.append(name)
            elif tuple(own[name].shape) != tuple(tensor.shape):
                misshaped.append(f"{name}: checkpoint {tuple(tensor.shape)} vs "
                                 f"expected {tuple(own[name].shape)}")
            else:
                with torch.no_grad():
                    own[name].copy_(tensor.to(own[name].dtype))
                loaded.add(name)
        missing = sorted(set(own) - loaded)
        if missing or unexpected or misshaped:
            raise ValueError("drafter checkpoint does not match the drafter config: "
                             f"missing {missing}, unexpected {sorted(unexpected)}, "
                             f"mis-shaped {misshaped}")
        if self.config.uses_draft_vocab:
            self.bind_draft_vocab()

    def bind_draft_vocab(self) -> None:
        """Check t2d/d2t agree, then derive the draft lm_head rows and the id map from them (again
        after setting t2d/d2t by hand, as training does)."""
        index = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        selected = torch.nonzero(self.t2d, as_tuple=False).squeeze(-1)
        if index.numel() != selected.numel() or not torch.equal(index.to(selected.device), selected):
            raise ValueError("vocabulary maps disagree: draft_id + d2t[draft_id] must list the "
                             f"t2d ids in order (t2d selects {selected.numel()} ids, "
                             f"draft_vocab_size is {self.config.draft_vocab_size})")
        self.draft_to_target_index = index
        self.draft_lm_head_weight = self.lm_head.weight.detach()[index].to(self.fc.weight.dtype)
        self.draft_lm_head_packed = None          # pack_for_inference packs the new rows again
        self.draft_lm_head_tiles = None


def block_mask(ctx_valid: torch.Tensor, slots: int) -> torch.Tensor:
    """ctx_valid [R, L] -> [R, 1, 1, L+S]: the context keys that exist, then every block key."""
    block_keys = torch.ones(ctx_valid.shape[0], slots, dtype=torch.bool, device=ctx_valid.device)
    return torch.cat([ctx_valid.bool(), block_keys], dim=1)[:, None, None, :]
