"""The shape-only twin of every tensor operator in csrc/register.cpp.

torch.compile traces a graph with fake tensors, which hold shapes and dtypes but no data: an
operator without a fake implementation cannot appear in a traced graph. Each twin answers what
its kernel allocates, from the arguments alone. `limits` and `amx_init` take no tensor, so they
run as they are under tracing and have none.
"""

from __future__ import annotations

import torch
from torch import Tensor

TILE_ROWS, TILE_COLUMNS = 16, 32         # output rows and input columns of one packed weight tile


def amx_pack(w: Tensor) -> Tensor:
    out, cols = w.shape
    return w.new_empty((-(-out // TILE_ROWS), -(-cols // TILE_COLUMNS), TILE_COLUMNS // 2, TILE_ROWS, 2))


def linear_bf16(x: Tensor, packed: Tensor, out: int, bias: Tensor | None, amx: bool) -> Tensor:
    return x.new_empty((x.shape[0], out))


def paged_attention_bf16(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                         token_keys: Tensor, block_size: int, scale: float, tiles: bool = False) -> Tensor:
    return q.new_empty(q.shape)


def argmax_rows_f32(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[:1], dtype=torch.long)


def markov_greedy_bf16(base: Tensor, h: Tensor, anchors: Tensor, w1: Tensor, w2: Tensor,
                       conf: Tensor | None, conf_bias: Tensor | None, draft_to_target: Tensor | None,
                       amx: bool) -> tuple[Tensor, Tensor]:
    rows, gamma = base.shape[:2]
    return anchors.new_empty((rows, gamma)), base.new_empty((rows, gamma))


def decoder_layer_bf16(x: Tensor, cos: Tensor, sin: Tensor, input_norm: Tensor, qkv: Tensor,
                       qkv_bias: Tensor | None, q_norm: Tensor | None, k_norm: Tensor | None, o: Tensor,
                       post_norm: Tensor, gate_up: Tensor, down: Tensor, k_cache: Tensor, v_cache: Tensor,
                       row_slots: Tensor, block_tables: Tensor, token_keys: Tensor, block_size: int, live: int,
                       heads: int, intermediate: int, eps: float, scale: float, block_rows: int,
                       amx: bool) -> Tensor:
    return x.new_empty(x.shape)


def context_kv_bf16(h: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, k_norm: Tensor | None,
                    k_cache: Tensor, v_cache: Tensor, row_slots: Tensor, eps: float, amx: bool) -> None:
    return None


FAKES = {f"dspark_cpu::{fn.__name__}": fn for fn in (
    amx_pack, linear_bf16, paged_attention_bf16, argmax_rows_f32, markov_greedy_bf16,
    decoder_layer_bf16, context_kv_bf16)}


def register_fakes() -> None:
    """Once, after the library is loaded (the operators must exist)."""
    for name, fn in FAKES.items():
        torch.library.register_fake(name)(fn)
