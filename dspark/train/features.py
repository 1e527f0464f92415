"""The frozen target's side of a training step: context features and teacher logits.

DeepSpec precomputes these into a multi-terabyte cache (§5.1); on a 2-core CPU with a 135M target
it is cheaper to run the target on the fly, once per batch, through the engine's own model code
(so the features are exactly the ones inference will feed the drafter). Only the rows that are
supervised get an LM-head pass: the vocabulary-sized teacher logits are the dominant tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.models.llama import CausalLM
from dspark.models.model_config import ModelConfig
from dspark.worker.inputs import RequestChunk, build_inputs
from dspark.worker.kv_cache import allocate_kv_cache


@dataclass
class TargetFeatures:
    aux_hidden: torch.Tensor      # [T, m*d] raw outputs of the target layers, every token
    teacher_logits: torch.Tensor  # [U, V] fp32 next-token logits at the requested rows


class TargetFeatureExtractor:
    """Runs the target over whole sequences with a scratch paged KV cache (grown on demand)."""

    def __init__(self, model: CausalLM, config: ModelConfig, layer_ids: tuple[int, ...],
                 kv_block_size: int = 16):
        self.model, self.config, self.layer_ids = model, config, tuple(layer_ids)
        self.block_size = kv_block_size
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def _ensure_cache(self, num_blocks: int) -> None:
        """Every batch overwrites the slots it reads, so the cache is only ever grown, never cleared."""
        if num_blocks > self.num_blocks:
            self.num_blocks = num_blocks
            self.kv = allocate_kv_cache(self.config, num_blocks, self.block_size, self.dtype,
                                        self.device)

    def _chunks(self, tokens: torch.Tensor, seq_offsets: torch.Tensor) -> list[RequestChunk]:
        chunks, next_block = [], 0
        offsets = seq_offsets.tolist()
        for lo, hi in zip(offsets[:-1], offsets[1:]):
            n = -(-(hi - lo) // self.block_size)
            chunks.append(RequestChunk(tokens[lo:hi].tolist(), 0, list(range(next_block, next_block + n)), 0))
            next_block += n
        self._ensure_cache(next_block)
        return chunks

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, seq_offsets: torch.Tensor,
                 rows: torch.Tensor) -> TargetFeatures:
        """tokens [T] (B sequences, starts in seq_offsets [B+1]); rows [U] flat rows whose
        next-token logits are wanted. no_grad rather than inference_mode: the aux hidden feeds
        the drafter's trainable projection, whose backward must save it."""
        inp = build_inputs(self._chunks(tokens, seq_offsets), self.block_size, self.device,
                           self.config.sliding_window)
        out = self.model(inp.input_ids, inp.positions, inp.attn, self.kv,
                         rows.to(self.device), aux_layer_ids=self.layer_ids)
        return TargetFeatures(aux_hidden=out.aux_hidden, teacher_logits=out.logits)
