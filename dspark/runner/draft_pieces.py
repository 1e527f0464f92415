"""The draft step's block pass as piecewise CUDA graphs (`--graph cuda`), one set per request bucket.

As for the target (backends.py), the pass is cut at its attention calls, whose shapes follow the
context length L rather than the bucket: `Drafter.block_enter`, one `Drafter.block_transition`
per layer, and the head (`block_outputs`), each one `torch.cuda.CUDAGraph`. The Markov loop runs
after the graphs, eagerly, because seeded rows draw noise of their own (sampler.NoiseKey).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

from dspark.models.drafter import BlockState, Drafter, block_mask
from dspark.runner.backends import CudaGraphPiece, PieceCapture, warm_up_and_capture
from dspark.runner.graphs import DUMMY_TOKEN_ID
from dspark.spec.draft import block_outputs

logger = logging.getLogger(__name__)


class DraftPieces:
    """One request bucket's block pass, callable as `block_pass` is (spec/draft.py: `run_block`).
    As PiecewiseRunner: static inputs refreshed in place, the head's outputs returned as copies."""

    def __init__(self, drafter: Drafter, rows: int, capture: PieceCapture):
        cfg = drafter.config
        device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        slots = cfg.num_block_slots
        self.block_ids = torch.full((rows, slots), cfg.mask_token_id, dtype=torch.long, device=device)
        self.positions = torch.arange(slots, device=device).repeat(rows, 1)           # [Rb, S]
        self.anchors = torch.full((rows,), DUMMY_TOKEN_ID, dtype=torch.long, device=device)
        self.attn_in = torch.zeros(rows, slots, cfg.num_heads * cfg.head_dim, dtype=dtype,
                                   device=device)                                     # [Rb, S, H*D]
        self.pieces = [capture(functools.partial(drafter.block_enter, self.block_ids, self.positions))]
        for i in range(cfg.num_layers):
            prev = self.pieces[-1].out
            self.pieces.append(capture(functools.partial(drafter.block_transition, i, prev, self.attn_in)))
        last = self.pieces[-1].out
        self.head = capture(functools.partial(block_outputs, drafter, last.x, self.anchors))

    def __call__(self, drafter: Drafter, block_ids: torch.Tensor, positions: torch.Tensor,
                 ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor], ctx_valid: torch.Tensor,
                 anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """block_ids/positions [Rb, S], ctx per layer [Rb, L, KVH, D], ctx_valid [Rb, L]
        -> (h [Rb, γ, d], base logits fp32 [Rb, γ, V_draft], Markov state or None)."""
        if block_ids.shape != self.block_ids.shape:
            raise ValueError(f"a bucket captured at {tuple(self.block_ids.shape)} block rows cannot "
                             f"replay {tuple(block_ids.shape)}")
        self.block_ids.copy_(block_ids)
        self.positions.copy_(positions)
        self.anchors.copy_(anchors)
        s: BlockState = self.pieces[0]()
        mask = block_mask(ctx_valid, block_ids.shape[1])
        for i in range(drafter.config.num_layers):
            self.attn_in.copy_(drafter.block_attention(i, s, ctx_k[i], ctx_v[i], mask))
            s = self.pieces[i + 1]()
        h, base, state = self.head()
        return h.clone(), base.clone(), None if state is None else state.clone()


def capture_draft_bucket(drafter: Drafter, rows: int, warm_up: Callable[[], object], pool) -> DraftPieces:
    """`warm_up` (the bucket's eager draft step on dummies, writing nothing), then the bucket's
    pieces captured into the draft step's pool."""
    pieces = warm_up_and_capture(drafter.fc.weight.device, warm_up,
                                 lambda: DraftPieces(drafter, rows, lambda fn: CudaGraphPiece(fn, pool)))
    logger.debug("captured the %d-request draft bucket as %d CUDA graphs", rows, len(pieces.pieces) + 1)
    return pieces
