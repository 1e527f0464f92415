"""Attention over a paged KV cache, for any mix of prefill chunks and decode/verify rows
(docs/internals.md). Tokens arrive flat in the ragged layout; each layer writes its new K/V through
the slot mapping, then attends: in place through dspark's CPU kernel (`token_keys`), through
FlashAttention's variable-length kernel on CUDA (`varlen`), else over a padded gather with SDPA.
The metadata is built once per step on the host and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.kernels import cpu as cpu_kernels
from dspark.models.layers import varlen_attention as varlen
from dspark.models.layers.varlen_attention import VarlenMetadata


@dataclass
class AttentionMetadata:
    num_reqs: int
    max_q: int                            # longest query of the step
    write_rows: torch.Tensor | None       # [W] token rows whose K/V are stored (None: all rows)
    write_slots: torch.Tensor             # [W] cache slots they go to (slot -1 rows are dropped)
    block_tables: torch.Tensor            # [R, NB] each request's KV blocks, padded
    block_size: int
    kv_len: int                           # L: keys per request after padding (<= NB * block)
    q_index: torch.Tensor | None          # [T] row of each token in the padded [R*max_q] query
    mask: torch.Tensor | None             # [R, 1, max_q, L] True = attend; None = attend all
    is_causal: bool = False               # single request, fresh prefill: plain causal SDPA
    num_tokens: int | None = None         # live rows; rows past them are bucket padding (None: all)
    parts: tuple["AttentionPart", ...] | None = None   # a mixed step attended group by group
    token_keys: torch.Tensor | None = None  # [T, 3] each token's request, first key and end key
    varlen: VarlenMetadata | None = None  # the step for FlashAttention's variable-length kernel


@dataclass
class AttentionPart:
    """Some requests of a step with their own (smaller) padding: a step that mixes one-token
    decode rows with a long prefill chunk would otherwise pad every decode row to the chunk's
    length. The step's metadata still describes the whole step (K/V writes, trimming)."""
    rows: torch.Tensor                    # [T_p] the step's token rows these requests own
    meta: AttentionMetadata               # over these requests only; writes nothing


def write_kv(cache: torch.Tensor, rows: torch.Tensor | None, slots: torch.Tensor,
             new: torch.Tensor) -> None:
    """cache [S, KVH, D]; new [T, KVH, D]."""
    if slots.numel() == 0:
        return
    cache.index_copy_(0, slots, new if rows is None else new.index_select(0, rows))


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                  kv_len: int) -> torch.Tensor:
    """cache [S, KVH, D] -> [R, KVH, L, D]; whole blocks are copied, one contiguous run each."""
    r, nb = block_tables.shape
    blocks = cache.view(-1, block_size * cache.shape[1] * cache.shape[2])
    out = blocks.index_select(0, block_tables.flatten())
    return out.view(r, nb * block_size, *cache.shape[1:])[:, :kv_len].transpose(1, 2)


@torch.compiler.disable
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] -> [T, H*D]: store the live rows' K/V, attend over the pages.
    Rows past `meta.num_tokens` (a bucket's padding) write nothing and output zeros. Eager under a
    compiled or captured graph: its shapes follow the context, not the bucket."""
    t, live = q.shape[0], meta.num_tokens if meta.num_tokens is not None else q.shape[0]
    if live == 0:                        # an all-dummy step (capture warm-up, idle DP rank)
        return q.new_zeros(t, q.shape[1] * q.shape[2])
    if live < t:
        q, k, v = q[:live], k[:live], v[:live]
    write_kv(kv[0], meta.write_rows, meta.write_slots, k)
    write_kv(kv[1], meta.write_rows, meta.write_slots, v)
    out = paged_attention(q, kv[0], kv[1], meta, scale)
    if live < t:
        out = torch.cat([out, out.new_zeros(t - live, out.shape[1])])
    return out


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One query per request: q [R, H, D], keys/values [R, KVH, L, D], mask [R, 1, 1, L] or None.
    Two batched matmuls (query heads grouped under their K/V head, fp32 softmax): on CPUs, faster
    than the fused SDPA kernel, which is tuned for long queries (docs/measurements.md)."""
    r, h, d = q.shape
    kvh, length = keys.shape[1], keys.shape[2]
    scores = torch.matmul(q.view(r, kvh, h // kvh, d), keys.transpose(-1, -2)).float() * scale
    if mask is not None:                                   # [R, KVH, G, L]
        scores = scores.masked_fill(~mask.view(r, 1, 1, length), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(r, h, d)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D] -> out [T, H*D]; the new K/V must already be in the cache."""
    t, h, d = q.shape
    if meta.varlen is not None:
        reason = varlen.refusal(q, k_cache, meta.varlen)
        if reason is None:
            return varlen.varlen_attention(q, k_cache, v_cache, meta.varlen, scale)
        varlen.note_fallback(reason)
    if meta.parts is not None:
        out = q.new_empty(t, h * d)
        for part in meta.parts:
            out.index_copy_(0, part.rows, paged_attention(q.index_select(0, part.rows), k_cache,
                                                          v_cache, part.meta, scale))
        return out
    r = meta.num_reqs
    if meta.token_keys is not None and cpu_kernels.takes_attention(q, k_cache, meta.max_q):
        return cpu_kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.token_keys,
                                           meta.block_size, scale).view(t, h * d)
    keys = gather_blocks(k_cache, meta.block_tables, meta.block_size, meta.kv_len)
    values = gather_blocks(v_cache, meta.block_tables, meta.block_size, meta.kv_len)
    qp = q if meta.q_index is None else q.new_zeros(r * meta.max_q, h, d).index_copy_(0, meta.q_index, q)
    qp = qp.view(r, meta.max_q, h, d)
    if meta.max_q == 1 and not meta.is_causal:
        return decode_attention(qp.view(r, h, d), keys, values, meta.mask, scale).reshape(r, h * d)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), keys, values, attn_mask=meta.mask, is_causal=meta.is_causal,
        scale=scale, enable_gqa=keys.shape[1] != h)       # [R, H, Q, D]
    out = out.transpose(1, 2).reshape(r * meta.max_q, h * d)
    return out if meta.q_index is None else out.index_select(0, meta.q_index)
