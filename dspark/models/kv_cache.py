"""The paged KV cache tensors, sized from a memory budget."""

from __future__ import annotations

import logging
import math
import mmap
import os

import torch

from dspark.config import CacheConfig
from dspark.models.model_config import ModelConfig

logger = logging.getLogger(__name__)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def num_blocks_for_budget(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                          device: torch.device, max_tokens_needed: int,
                          extra_bytes_per_block: int = 0) -> int:
    """Blocks that fit the budget, capped at what `max_tokens_needed` concurrent tokens use;
    `extra_bytes_per_block` is what else lives in each block (the drafter's context K/V)."""
    per_block = bytes_per_block(cfg, cache.block_size, dtype) + extra_bytes_per_block
    budget = cache.kv_cache_bytes
    if budget is None:
        free = (torch.cuda.mem_get_info(device)[0] if device.type == "cuda"
                else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        budget = int(free * cache.memory_fraction)
    blocks = min(budget // per_block, -(-max_tokens_needed // cache.block_size))
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", blocks, cache.block_size,
                blocks * per_block / 2**20)
    return int(blocks)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_blocks * block_size, kv_heads, head_dim], all zeros."""
    shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(untouched_zeros(shape, dtype, device), untouched_zeros(shape, dtype, device))
            for _ in range(cfg.num_layers)]


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost nothing until written. On the CPU `torch.zeros` writes every byte of a
    cache sized in gigabytes before the first request (seconds of start-up, all of it resident);
    an anonymous mapping is zero by the operating system's guarantee and gets its pages at
    their first write, so only the blocks requests use are ever paid for. Masked reads past a
    request's context still see zeros, as with `torch.zeros`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
