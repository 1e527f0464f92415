"""The frozen target's side of a training step: context features and teacher logits.

DeepSpec precomputes these into a multi-terabyte cache (§5.1); on a 2-core CPU with a 135M target
the first pass runs the target on the fly, through the engine's own model code (so the features
are exactly the ones inference will feed the drafter), and keeps each sequence's features in
memory up to a byte budget: later epochs then skip the target forward, which is most of a step.
What is kept is the aux hidden plus the last layer's output; teacher logits are recomputed from it
(final norm + LM head, only at supervised rows), since vocabulary-sized rows are the tensor that
would not fit.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from dspark.models.llama import CausalLM
from dspark.models.model_config import ModelConfig
from dspark.worker.inputs import RequestChunk, build_inputs
from dspark.models.kv_cache import allocate_kv_cache


@dataclass
class TargetFeatures:
    aux_hidden: torch.Tensor      # [T, m*d] raw outputs of the target layers, every token
    teacher_logits: torch.Tensor  # [U, V] fp32 next-token logits at the requested rows


class TargetFeatureExtractor:
    """Runs the target over whole sequences with a scratch paged KV cache (grown on demand) and
    caches per-sequence features by key while they fit in `cache_bytes`."""

    def __init__(self, model: CausalLM, config: ModelConfig, layer_ids: tuple[int, ...],
                 kv_block_size: int = 16, cache_bytes: int = 0):
        self.model, self.config, self.layer_ids = model, config, tuple(layer_ids)
        self.block_size = kv_block_size
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.cache_bytes = cache_bytes
        self.cache: dict[Hashable, torch.Tensor] = {}     # key -> [S, m*d + d]
        self.cached_bytes = 0
        self.hits = self.misses = 0

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def _ensure_cache(self, num_blocks: int) -> None:
        """Every batch overwrites the slots it reads, so the KV cache is only ever grown."""
        if num_blocks > self.num_blocks:
            self.num_blocks = num_blocks
            self.kv = allocate_kv_cache(self.config, num_blocks, self.block_size, self.dtype,
                                        self.device)

    def _chunks(self, seqs: list[torch.Tensor]) -> list[RequestChunk]:
        chunks, next_block = [], 0
        for seq in seqs:
            n = -(-seq.numel() // self.block_size)
            chunks.append(RequestChunk(seq.tolist(), 0, list(range(next_block, next_block + n)), 0))
            next_block += n
        self._ensure_cache(next_block)
        return chunks

    def _run_target(self, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per sequence [S, m*d + d]: the aux layers, then the last layer's (pre-norm) output."""
        inp = build_inputs(self._chunks(seqs), self.block_size, self.device,
                           self.config.sliding_window)
        last = self.config.num_layers - 1
        out = self.model(inp.input_ids, inp.positions, inp.attn, self.kv,
                         torch.zeros(0, dtype=torch.long, device=self.device),
                         aux_layer_ids=self.layer_ids + (last,))
        return list(out.aux_hidden.split([s.numel() for s in seqs]))

    def _features(self, seqs: list[torch.Tensor], keys: Sequence[Hashable] | None) -> torch.Tensor:
        keys = keys if keys is not None else [None] * len(seqs)
        missing = [i for i, k in enumerate(keys) if k is None or k not in self.cache]
        fresh = dict(zip(missing, self._run_target([seqs[i] for i in missing]))) if missing else {}
        self.hits += len(seqs) - len(missing)
        self.misses += len(missing)
        for i, feats in fresh.items():
            size = feats.numel() * feats.element_size()
            if keys[i] is not None and self.cached_bytes + size <= self.cache_bytes:
                self.cache[keys[i]] = feats.clone()      # not a view of the whole batch
                self.cached_bytes += size
        return torch.cat([fresh[i] if i in fresh else self.cache[keys[i]] for i in range(len(seqs))])

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, seq_offsets: torch.Tensor, rows: torch.Tensor,
                 keys: Sequence[Hashable] | None = None) -> TargetFeatures:
        """tokens [T] (B sequences, starts in seq_offsets [B+1]); rows [U] flat rows whose
        next-token logits are wanted; keys name the sequences for the cache (None: no caching).
        no_grad rather than inference_mode: the aux hidden feeds the drafter's trainable
        projection, whose backward must save it."""
        offsets = seq_offsets.tolist()
        seqs = [tokens[lo:hi] for lo, hi in zip(offsets[:-1], offsets[1:])]
        feats = self._features(seqs, keys)                                  # [T, m*d + d]
        width = len(self.layer_ids) * self.config.hidden_size
        final = feats[rows.to(self.device), width:]                         # [U, d]
        logits = self.model.lm_head(self.model.norm(final)).float()         # [U, V]
        return TargetFeatures(aux_hidden=feats[:, :width], teacher_logits=logits)
