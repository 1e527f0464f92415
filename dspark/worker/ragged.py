"""Trimming a verify-all step to the verify lengths the allocator chose, on the device.

The host lays a speculative step out as if every block were verified in full (anchor + cap_r
rows per request); the allocator then picks ℓ_r <= cap_r on the device from the current
confidences. Only the totals are known on the host beforehand (the budget is), so the rows to
keep are selected with fixed-size ops: a stable sort of the keep flags puts the kept rows first
in their original order, and the first `num_kept` of them are taken. Every dropped row is a draft
row after its request's ℓ_r, so the kept rows of a request stay a prefix: their positions, slots
and causal masks are unchanged, and no kept row attends a dropped one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dspark.models.layers.attention import AttentionPart
from dspark.worker.inputs import RequestChunk, StepInputs


@dataclass
class RowLayout:
    """Host-built description of the verify-all layout (moved to the device once per step)."""
    spec_index: torch.Tensor     # [T] speculative chunk (0..R_spec-1) each row belongs to, -1 if none
    row_in_chunk: torch.Tensor   # [T] offset of the row inside its chunk (0 = the anchor)
    chunk_spec: torch.Tensor     # [C] speculative index of each chunk, -1 if none


def row_layout(chunks: list[RequestChunk], is_spec: list[bool], device: torch.device) -> RowLayout:
    """is_spec per chunk (False for prefill and plain decode chunks)."""
    spec_ids = (torch.tensor(is_spec, dtype=torch.long).cumsum(0) - 1).tolist()
    chunk_spec = [j if spec else -1 for j, spec in zip(spec_ids, is_spec)]
    spec_index = [j for chunk, j in zip(chunks, chunk_spec) for _ in chunk.token_ids]
    offsets = [i for chunk in chunks for i in range(len(chunk.token_ids))]
    to = lambda x: torch.tensor(x, dtype=torch.long).to(device, non_blocking=True)  # noqa: E731
    return RowLayout(to(spec_index), to(offsets), to(chunk_spec))


def _first_true(flags: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the first `count` True entries, in order, without a host sync."""
    return torch.sort((~flags).to(torch.int8), stable=True).indices[:count]


def trim_inputs(inputs: StepInputs, layout: RowLayout, verify_lens: torch.Tensor, num_dropped: int
                ) -> tuple[StepInputs, torch.Tensor]:
    """Keep rows with row_in_chunk <= ℓ of their speculative chunk (all rows of other chunks).

    verify_lens [R_spec] on the device; `num_dropped` = Σ cap − Σ ℓ, known on the host. Returns
    the trimmed inputs and, for each kept logits row, its index in the untrimmed logits list.
    """
    attn = inputs.attn
    if attn.write_rows is not None or (attn.mask is None and attn.parts is None):
        raise ValueError("trimming needs every row to write K/V and a per-request mask")
    ell = verify_lens[layout.spec_index.clamp(min=0)]
    keep = (layout.spec_index < 0) | (layout.row_in_chunk <= ell)                  # [T]
    total = keep.shape[0]
    rows = _first_true(keep, total - num_dropped)                                  # [T']
    new_row = keep.long().cumsum(0) - 1                                            # [T]
    logits_keep = _first_true(keep[inputs.logits_indices], inputs.logits_indices.shape[0] - num_dropped)
    q_index = attn.q_index if attn.q_index is not None else torch.arange(total, device=keep.device)
    parts = None if attn.parts is None else tuple(            # speculative chunks: first part
        _trim_part(part, keep, new_row, num_dropped if i == 0 else 0) for i, part in enumerate(attn.parts))
    trimmed_attn = dataclasses.replace(
        attn, write_slots=attn.write_slots[rows], q_index=q_index[rows], parts=parts,
        token_keys=None if attn.token_keys is None else attn.token_keys[rows])
    q_lens = inputs.qo_indptr.diff()
    spec = layout.chunk_spec
    dropped = torch.where(spec >= 0, q_lens - 1 - verify_lens[spec.clamp(min=0)], 0)
    indptr = torch.cat([inputs.qo_indptr[:1], (q_lens - dropped).cumsum(0)])
    trimmed = StepInputs(input_ids=inputs.input_ids[rows], positions=inputs.positions[rows],
                         qo_indptr=indptr,
                         logits_indices=new_row[inputs.logits_indices[logits_keep]], attn=trimmed_attn)
    return trimmed, logits_keep


def _trim_part(part: AttentionPart, keep: torch.Tensor, new_row: torch.Tensor, dropped: int
               ) -> AttentionPart:
    """A part's kept rows, renumbered. Only draft rows are dropped, and every speculative chunk
    is in the step's first part (inputs._parts): it loses all `dropped` rows, the prefill part
    none."""
    kept = _first_true(keep[part.rows], part.rows.shape[0] - dropped)
    q_index = part.meta.q_index
    if q_index is None:
        q_index = torch.arange(part.rows.shape[0], device=kept.device)
    keys = part.meta.token_keys
    return AttentionPart(rows=new_row[part.rows[kept]], meta=dataclasses.replace(
        part.meta, q_index=q_index[kept], token_keys=None if keys is None else keys[kept]))


def untrim_logits(logits: torch.Tensor, logits_keep: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[N', V] kept rows -> [N, V] in the verify-all layout (zeros where trimmed: never read,
    since acceptance stops at ℓ)."""
    full = logits.new_zeros(num_rows, logits.shape[-1])
    return full.index_copy_(0, logits_keep, logits)
