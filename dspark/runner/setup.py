"""Choosing the runner once, at start-up: weights packed for the device, the fused CPU layer
kernel where it runs, the graph backend (`auto` resolved by choice.py) and its buckets, logged
with the reason for each choice so that a slow start or a slow step can be traced to it."""

from __future__ import annotations

import logging
import os

import torch

from dspark.config import EngineConfig
from dspark.models.drafter import Drafter
from dspark.kernels import cpu as cpu_kernels
from dspark.models.layers.linear import can_pack, pack_linears, pack_weight
from dspark.models.llama import CausalLM
from dspark.runner.choice import auto_mode, default_cache_path
from dspark.runner.fused_cpu import fuse_draft_blocks, fuse_small_steps
from dspark.runner.graphs import StepGraphs, token_buckets
from dspark.runner.runner import Runner

logger = logging.getLogger(__name__)


def build_runner(model: CausalLM, drafter: Drafter | None, config: EngineConfig,
                 device: torch.device) -> Runner:
    """The runner of one engine. Its buckets are captured later, over the KV caches
    (`Runner.capture`), because the caches are sized after the packed weights are in memory."""
    pack_for_inference(model, drafter)
    fused = fuse_small_steps(model)
    fused_draft = fuse_draft_blocks(drafter) if drafter is not None else None
    sched = config.scheduler
    buckets = token_buckets(min(config.max_graph_tokens, sched.max_num_batched_tokens))
    aux = drafter.config.target_layer_ids if drafter is not None else ()
    mode = config.graph
    if mode == "auto":
        model_id = os.path.abspath(config.model) if config.model else "embedded"
        mode = auto_mode(model, device, aux, {"model": model_id, "dtype": config.dtype}, default_cache_path())
    graphs = StepGraphs(model, mode, buckets, device, aux, config.graph_fallback, fused)
    logger.info("runner: %s at %d token buckets (1..%d)%s; %s", mode, len(buckets), buckets[-1],
                " chosen by --graph auto" if config.graph == "auto" else "",
                _fused_reason(model, fused, drafter, fused_draft))
    return Runner(model, graphs, drafter, fused_draft, sched.max_num_seqs)


def pack_for_inference(target: CausalLM, drafter: Drafter | None) -> int:
    """Pack an engine's target and drafter. The target's LM head keeps its plain weight: it may
    be tied to the embeddings, and a drafter derives its reduced-vocabulary head from it."""
    tiles = can_pack(target.lm_head.weight) and cpu_kernels.available()
    amx = tiles and cpu_kernels.tiles_available()
    count = sum(pack_linears(layer, drop_dense=True, tiles=tiles) for layer in target.layers)
    count += pack_linears(target.lm_head, drop_dense=False, tiles=tiles)
    if drafter is not None:
        count += pack_linears(drafter, drop_dense=True, tiles=tiles)
        head = getattr(drafter, "draft_lm_head_weight", None)
        if head is not None and head.numel() and can_pack(head):
            drafter.draft_lm_head_packed = pack_weight(head)     # its reduced-vocabulary head
            drafter.draft_lm_head_tiles = cpu_kernels.pack_tiles(head) if tiles else None
            drafter.draft_lm_head_amx = amx
            count += 1
    if count:
        logger.info("packed %d projection weights in oneDNN's layout%s", count,
                    f", and tile by tile for steps of up to {cpu_kernels.tile_rows(amx)} rows" if tiles else "")
    return count


def _fused_reason(model: CausalLM, fused, drafter: Drafter | None, fused_draft) -> str:
    """Which steps the fused CPU layer kernel takes, or why none."""
    if fused is not None:
        draft = "" if drafter is None else (", draft blocks too" if fused_draft is not None
                                            else ", draft blocks not (the drafter's layers do not qualify)")
        return f"steps of up to {fused.max_rows} rows run each layer as one fused kernel call{draft}"
    if model.embed_tokens.weight.device.type != "cpu":
        return "no fused layer kernel (a CPU kernel)"
    if not cpu_kernels.available():
        return "no fused layer kernel (it needs an x86 CPU with AVX512-BF16 and a C++ compiler)"
    if model.embed_tokens.weight.dtype != torch.bfloat16:
        return "no fused layer kernel (it runs bf16 weights)"
    return "no fused layer kernel (the model's layers do not qualify)"
