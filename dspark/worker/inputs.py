"""Scheduled requests -> flat (ragged) model inputs and the attention metadata of one step.

Everything is built on the host. For a CUDA device every tensor of the step (ids, positions,
slots, block tables, masks, the variable-length attention's offsets and gather index) is packed
into one pinned buffer and copied once, without blocking: a copy from pageable memory first waits
for the work already queued on the device, and a step has a dozen such tensors.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.host_copy import to_device
from dspark.models.layers import varlen_attention
from dspark.models.layers.attention import AttentionMetadata, AttentionPart
from dspark.models.layers.varlen_attention import VarlenMetadata
from dspark.worker.penalties import TokenHistory


@dataclass
class RequestChunk:
    """One request's share of a step, as the worker needs it."""
    token_ids: list[int]        # the new tokens whose KV this step writes
    start: int                  # position of token_ids[0] (= tokens already in the cache)
    block_table: list[int]
    num_logits: int             # logits rows wanted, taken from the end of the chunk (0: none)
    prompt_rows: range = range(0)   # rows whose logits also come back, before those (prompt log-probs)
    history: TokenHistory | None = None   # a sampling chunk's penalties read it (None: no penalty)


@dataclass
class StepInputs:
    input_ids: torch.Tensor          # [T]
    positions: torch.Tensor          # [T]
    logits_indices: torch.Tensor     # [N] rows whose logits are computed
    attn: AttentionMetadata


def build_inputs(chunks: list[RequestChunk], block_size: int, device: torch.device,
                 sliding_window: int | None = None, varlen: bool | None = None) -> StepInputs:
    """varlen: also describe the step for FlashAttention's variable-length kernel (default: on
    CUDA, where attention takes it)."""
    q_lens = [len(c.token_ids) for c in chunks]
    starts = [c.start for c in chunks]
    ctx_lens = [s + q for s, q in zip(starts, q_lens)]
    ids = [t for c in chunks for t in c.token_ids]
    positions = [c.start + j for c in chunks for j in range(len(c.token_ids))]
    indptr = list(itertools.accumulate(q_lens, initial=0))
    logits = [i for c, begin, end in zip(chunks, indptr, indptr[1:])
              for i in (*(begin + r for r in c.prompt_rows), *range(end - c.num_logits, end))]
    tables = torch.tensor(padded_tables(chunks), dtype=torch.long)
    slots = torch.tensor(_slots(chunks, block_size), dtype=torch.long)                # -1: no write
    every_row = [c.num_logits == len(c.token_ids) for c in chunks]          # decode and verify rows
    attn = _metadata(q_lens, indptr, every_row, starts, ctx_lens, tables, slots, block_size,
                     sliding_window, in_place_keys=device.type == "cpu")
    if varlen or (varlen is None and device.type == "cuda"):
        attn = dataclasses.replace(attn, varlen=_varlen_metadata(q_lens, indptr, ctx_lens, tables,
                                                                 block_size, sliding_window))
    long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    host = StepInputs(input_ids=long(ids), positions=long(positions), logits_indices=long(logits), attn=attn)
    return host if device.type == "cpu" else to_device(host, device)


def _varlen_metadata(q_lens: list[int], indptr: list[int], ctx_lens: list[int], tables: torch.Tensor,
                     block_size: int, window: int | None) -> VarlenMetadata:
    """Query and key offsets, and either the pages (block tables the kernel reads in place) or
    the cache slot of every key of every request in order (one gather per layer)."""
    r, max_ctx = len(ctx_lens), max(ctx_lens)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), ctx.cumsum(0, dtype=torch.int32)])
    width = -(-max_ctx // block_size)
    tables = F.pad(tables, (0, max(0, width - tables.shape[1])))[:, :width].clamp(min=0)  # dummies: block 0
    common = dict(cu_seq_q=torch.tensor(indptr, dtype=torch.int32), cu_seq_k=cu_k, max_q=max(q_lens),
                  max_k=max_ctx, page_size=block_size, window=window)
    if varlen_attention.paged_layout(block_size):
        return VarlenMetadata(**common, kv_index=None, block_table=tables.to(torch.int32).contiguous(),
                              seqused_k=ctx)
    slots = (tables[:, :, None] * block_size + torch.arange(block_size)).view(r, -1)    # [R, NB*bs]
    kv_index = slots[torch.arange(slots.shape[1])[None, :] < ctx[:, None]].to(torch.int32)
    return VarlenMetadata(**common, kv_index=kv_index, block_table=None, seqused_k=None)


def _slots(chunks: list[RequestChunk], block_size: int) -> list[int]:
    """Each new token's cache slot (-1 where its block is negative: no write). Plain Python: a
    decode step has a handful of tokens, for which the loop costs less than the dozen small
    tensor operations that would compute the same."""
    slots = []
    for c in chunks:
        table = c.block_table
        for pos in range(c.start, c.start + len(c.token_ids)):
            b = pos // block_size
            block = table[b] if b < len(table) else 0          # as the zero-padded table reads
            slots.append(-1 if block < 0 else block * block_size + pos % block_size)
    return slots


def padded_tables(chunks: list[RequestChunk]) -> list[list[int]]:
    """[R, widest] the chunks' block tables, zero-padded."""
    width = max(1, *(len(c.block_table) for c in chunks))
    return [c.block_table + [0] * (width - len(c.block_table)) for c in chunks]


SPLIT_MIN_Q = 16     # queries at least this long (prefill chunks) are attended apart from shorter ones


def _metadata(q_lens: list[int], indptr: list[int], every_row: list[bool], starts: list[int],
              ctx_lens: list[int], tables: torch.Tensor, slots: torch.Tensor, block_size: int,
              window: int | None, in_place_keys: bool) -> AttentionMetadata:
    parts = _parts(q_lens, indptr, every_row, starts, ctx_lens, tables, block_size, window, in_place_keys)
    if parts is None:
        meta = _request_metadata(q_lens, starts, ctx_lens, tables, block_size, window, in_place_keys)
    else:        # attention reads the parts alone: no step-wide padded query or mask is built
        meta = AttentionMetadata(num_reqs=len(q_lens), max_q=max(q_lens), write_rows=None,
                                 write_slots=slots, block_tables=tables.clamp(min=0),
                                 block_size=block_size, kv_len=max(ctx_lens), q_index=None,
                                 mask=None, parts=parts)
    valid = slots >= 0
    all_valid = bool(valid.all())
    return dataclasses.replace(
        meta, write_rows=None if all_valid else valid.nonzero().flatten(),
        write_slots=slots if all_valid else slots[valid])


def _parts(q_lens: list[int], indptr: list[int], every_row: list[bool], starts: list[int],
           ctx_lens: list[int], tables: torch.Tensor, block_size: int, window: int | None,
           in_place_keys: bool) -> tuple[AttentionPart, ...] | None:
    """Decode rows, verify blocks and short prefill chunks as the first group, long prefill
    chunks as the second, when a step has both: each group padded to its own longest query and
    context, so a prompt joining the step does not pad every verify block to its chunk
    (docs/measurements.md), and the first stays within what the CPU kernel reads in place."""
    first = [q < SPLIT_MIN_Q or every for q, every in zip(q_lens, every_row)]
    short = [i for i, f in enumerate(first) if f]
    chunked = [i for i, f in enumerate(first) if not f]
    if not short or not chunked:
        return None
    parts = []
    for group in (short, chunked):
        pick = lambda xs: [xs[i] for i in group]  # noqa: E731
        rows = torch.tensor([j for i in group for j in range(indptr[i], indptr[i + 1])])
        meta = _request_metadata(pick(q_lens), pick(starts), pick(ctx_lens), tables[group],
                                 block_size, window, in_place_keys)
        parts.append(AttentionPart(rows=rows, meta=meta))
    return tuple(parts)


def _request_metadata(q_lens: list[int], starts: list[int], ctx_lens: list[int], tables: torch.Tensor,
                      block_size: int, window: int | None, in_place_keys: bool) -> AttentionMetadata:
    """What attention needs of these requests (query padding, mask, block tables); no writes.
    in_place_keys: also each token's key range, which only the CPU kernel reads."""
    r, max_q, max_ctx = len(q_lens), max(q_lens), max(ctx_lens)
    tables = tables[:, :-(-max_ctx // block_size)]
    uniform = all(q == max_q for q in q_lens)
    q_index = None
    if not uniform:
        q_index = torch.cat([torch.arange(q) + i * max_q for i, q in enumerate(q_lens)])
    windowed = window is not None and max_ctx > window
    mask, causal = None, False
    if r == 1 and starts[0] == 0 and max_q > 1 and not windowed:
        causal = True
    elif windowed or max_q > 1 or any(c != max_ctx for c in ctx_lens):
        mask = _mask(q_lens, starts, max_q, max_ctx, window)
    return AttentionMetadata(
        num_reqs=r, max_q=max_q, write_rows=None, write_slots=torch.zeros(0, dtype=torch.long),
        block_tables=tables.clamp(min=0), block_size=block_size, kv_len=max_ctx, q_index=q_index,
        mask=mask, is_causal=causal,
        token_keys=_token_keys(q_lens, starts, window) if in_place_keys else None)


def _token_keys(q_lens: list[int], starts: list[int], window: int | None) -> torch.Tensor:
    """[T, 3]: each token's request, first key and end key (causal, within the window): the
    per-token form of `_mask`, for kernels that read keys in place (built in Python, as `_slots`)."""
    keys = [(r, max(0, end - window) if window is not None else 0, end)
            for r, (q, start) in enumerate(zip(q_lens, starts)) for end in range(start + 1, start + q + 1)]
    return torch.tensor(keys, dtype=torch.long).view(-1, 3)


def _mask(q_lens, starts, max_q, max_ctx, window) -> torch.Tensor:
    q_pos = torch.tensor(starts)[:, None] + torch.arange(max_q)[None, :]          # [R, Q]
    key_pos = torch.arange(max_ctx)[None, None, :]                                 # [1, 1, L]
    mask = key_pos <= q_pos[:, :, None]                                            # [R, Q, L]
    if window is not None:
        mask &= key_pos > q_pos[:, :, None] - window
    padded_q = torch.arange(max_q)[None, :] >= torch.tensor(q_lens)[:, None]       # [R, Q]
    mask[padded_q] = False
    mask[..., 0] |= padded_q            # padded query rows attend one key: no NaN rows
    return mask[:, None]
