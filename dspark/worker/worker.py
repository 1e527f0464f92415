"""Owns the model, the KV cache and the sampler; runs one step with one device->host copy."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dspark.models.llama import CausalLM
from dspark.models.model_config import ModelConfig
from dspark.sampling_params import SamplingParams
from dspark.worker.inputs import RequestChunk, build_inputs
from dspark.worker.kv_cache import allocate_kv_cache
from dspark.worker.sampler import SamplingTensors, sample

logger = logging.getLogger(__name__)


@dataclass
class WorkerBatch:
    chunks: list[RequestChunk]
    params: list[SamplingParams]                  # one per chunk that samples (num_logits == 1)
    generators: list[torch.Generator | None]


class Worker:
    def __init__(self, model: CausalLM, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_cache(config, num_blocks, block_size, dtype, device)

    @torch.inference_mode()
    def execute(self, batch: WorkerBatch) -> list[int]:
        """Forward every chunk, sample the rows that finish their known tokens, return them."""
        inputs = build_inputs(batch.chunks, self.block_size, self.device, self.config.sliding_window)
        out = self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_caches,
                         inputs.logits_indices)
        if not batch.params:
            return []
        st = SamplingTensors.build(batch.params, batch.generators, self.config.vocab_size, self.device)
        return sample(out.logits, st).tolist()      # the step's one device -> host copy
