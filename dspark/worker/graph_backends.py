"""How each graph backend turns a bucket into something runnable (see graphs.py)."""

from __future__ import annotations

import logging

import torch
import torch._dynamo

from dspark.models.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def build_runner(graphs, bucket: int, kv_caches, meta: AttentionMetadata):
    """-> callable(ids [B], positions [B], meta, kv_caches) -> (hidden, aux), or None (eager)."""
    if graphs.mode == "eager":
        return None
    if graphs.mode == "compile":
        return _compiled(graphs, bucket, kv_caches, meta)
    raise ValueError(f"graph mode {graphs.mode!r} has no backend on this build")


def _compiled(graphs, bucket: int, kv_caches, meta: AttentionMetadata):
    """One torch.compile of the decoder stack; dynamo specialises it per bucket shape (the
    recompile limit is raised to the bucket count). Freezing lets inductor prepack the weights
    for oneDNN, which is where the CPU gain comes from; the weights must not change afterwards."""
    if graphs.compiled is None:
        dynamo = torch._dynamo.config
        dynamo.cache_size_limit = max(dynamo.cache_size_limit, 4 * len(graphs.buckets))
        dynamo.accumulated_cache_size_limit = max(dynamo.accumulated_cache_size_limit,
                                                  16 * dynamo.cache_size_limit)
        options = {"freezing": True} if graphs.device.type == "cpu" else {}
        graphs.compiled = torch.compile(graphs.model.forward_hidden, dynamic=False, options=options)
    fn = graphs.compiled
    aux = graphs.aux_layer_ids

    def run(ids, positions, step_meta, caches):
        return fn(ids, positions, step_meta, caches, aux)

    with torch.inference_mode():
        run(graphs.input_ids[bucket], graphs.positions[bucket], meta, kv_caches)    # compiles
    return run
