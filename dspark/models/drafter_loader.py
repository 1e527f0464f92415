"""Read a DSpark drafter checkpoint (speculators or DeepSpec format) against a loaded target
(reference/dspark_algorithm.md §4; train/export.py writes the speculators format).

DeepSpec's `target_layer_ids` count decoder-layer outputs (-1 = embeddings), speculators'
`aux_hidden_state_layer_ids` layer boundaries (0 = embeddings): dspark uses the DeepSpec count, so
speculators ids are shifted by one here and in train/export.py, nowhere else. speculators'
`block_size` counts block rows, DeepSpec's (and DrafterConfig's) the drafts.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from dspark.models.drafter import Drafter, DrafterConfig
from dspark.models.loader import build_on_meta, read_config_json, safetensors_files
from dspark.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

SPECULATORS_TYPES = ("dspark", "dflash")
DEEPSPEC_ARCHITECTURES = ("Qwen3DSparkModel",)
# held by the target and shared; a checkpoint's copies are only checked for shape
SHARED_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")
# speculators training-only modules that never reach a saved checkpoint (tolerated if present)
TRAINING_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")


def load_drafter(path: str, target: ModelConfig, embed_tokens: nn.Embedding, lm_head: nn.Module,
                 dtype: torch.dtype) -> Drafter:
    """Build the drafter for `target`, sharing its embedding and LM head (and their device)."""
    cfg = drafter_config_from_hf(read_drafter_config(path), target)
    _validate(cfg, target)
    tensors = _read_tensors(path)
    _check_shared_shapes(tensors, cfg, target)
    drafter = build_on_meta(lambda: Drafter(cfg, embed_tokens, lm_head), cfg,
                            cfg.max_position_embeddings + cfg.num_block_slots,
                            embed_tokens.weight.device, dtype)
    drafter.load_weights(_drafter_tensors(tensors, cfg))
    _check_reduced_lm_head(tensors, drafter)
    logger.info("drafter %s: %d layers, γ=%d, layers %s, markov %s(r=%d), confidence %s",
                path, cfg.num_layers, cfg.block_size, list(cfg.target_layer_ids),
                cfg.markov_head_type if cfg.markov_rank else "none", cfg.markov_rank,
                cfg.enable_confidence_head)
    return drafter.eval().requires_grad_(False)


def drafter_config_from_hf(raw: dict[str, Any], target: ModelConfig) -> DrafterConfig:
    if raw.get("speculators_model_type") in SPECULATORS_TYPES:
        return _speculators_config(raw, target)
    if any(a in DEEPSPEC_ARCHITECTURES for a in raw.get("architectures") or []):
        return _deepspec_config(raw, target)
    raise ValueError("unrecognised drafter config: expected speculators_model_type in "
                     f"{list(SPECULATORS_TYPES)} or architectures {list(DEEPSPEC_ARCHITECTURES)}, "
                     f"got speculators_model_type={raw.get('speculators_model_type')!r}, "
                     f"architectures={raw.get('architectures')!r}")


def _speculators_config(raw: dict[str, Any], target: ModelConfig) -> DrafterConfig:
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("speculators drafter config has no transformer_layer_config")
    if "sliding_attention" in (layer.get("layer_types") or []):
        raise ValueError("drafters with sliding-window draft layers are not supported "
                         f"(layer_types={layer['layer_types']})")
    aux = raw.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError("speculators drafter config has no aux_hidden_state_layer_ids")
    dflash = raw["speculators_model_type"] == "dflash"
    sample_from_anchor = bool(raw.get("sample_from_anchor", not dflash))
    rows = int(raw.get("block_size", 8))
    if rows < (1 if sample_from_anchor else 2):
        raise ValueError(f"block_size {rows} with sample_from_anchor={sample_from_anchor} "
                         f"leaves {rows if sample_from_anchor else rows - 1} draft tokens; "
                         "at least 1 is needed")
    confidence = not dflash and bool(raw.get("enable_confidence_head", True))
    rank = 0 if dflash else int(raw.get("markov_rank", 256))
    shape = _layer_shapes(layer)
    return _make_config(
        shape, raw, target,
        block_size=rows if sample_from_anchor else rows - 1,
        target_layer_ids=tuple(int(i) - 1 for i in aux),
        sample_from_anchor=sample_from_anchor,
        mask_token_id=_required(raw, "mask_token_id"),
        markov_rank=rank,
        enable_confidence_head=confidence,
        confidence_head_with_markov=confidence and bool(raw.get("confidence_head_with_markov", True)),
        target_hidden_size=int(raw.get("target_hidden_size") or shape.hidden_size),
        draft_vocab_size=int(raw.get("draft_vocab_size") or shape.vocab_size),
    )


def _deepspec_config(raw: dict[str, Any], target: ModelConfig) -> DrafterConfig:
    shape = _layer_shapes(raw)
    rank = int(raw.get("markov_rank", 0))
    confidence = bool(raw.get("enable_confidence_head", False))
    return _make_config(
        shape, raw, target,
        block_size=int(_required(raw, "block_size")),           # DrafterConfig checks >= 1
        target_layer_ids=tuple(int(i) for i in _required(raw, "target_layer_ids")),
        sample_from_anchor=True,
        mask_token_id=_required(raw, "mask_token_id"),
        markov_rank=rank,
        enable_confidence_head=confidence,
        confidence_head_with_markov=confidence and bool(raw.get("confidence_head_with_markov", False)),
        target_hidden_size=shape.hidden_size,
        draft_vocab_size=shape.vocab_size,
    )


def _layer_shapes(layer: dict[str, Any]) -> ModelConfig:
    """Both formats describe the draft layers as a Qwen3 config (q/k norm, optional bias)."""
    return ModelConfig.from_hf({**layer, "architectures": ["Qwen3ForCausalLM"]})


def _make_config(shape: ModelConfig, raw: dict[str, Any], target: ModelConfig,
                 **fields: Any) -> DrafterConfig:
    """The fields both formats spell alike, around the format-specific `fields`."""
    return DrafterConfig(
        hidden_size=shape.hidden_size, num_layers=shape.num_layers, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size, rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta, rope_scaling=shape.rope_scaling, qk_norm=True,
        attention_bias=shape.qkv_bias, vocab_size=shape.vocab_size,
        markov_head_type=str(raw.get("markov_head_type", "vanilla")).lower(),
        max_position_embeddings=max(shape.max_position_embeddings, target.max_position_embeddings),
        **fields)


def _validate(cfg: DrafterConfig, target: ModelConfig) -> None:
    """Mismatches with the target, each named with both values."""
    for ours, theirs, why in (("vocab_size", "vocab_size", ""), ("target_hidden_size", "hidden_size", ""),
                              ("hidden_size", "hidden_size",
                               " (the drafter shares the target's embedding and lm_head)")):
        if getattr(cfg, ours) != getattr(target, theirs):
            raise ValueError(f"drafter {ours} {getattr(cfg, ours)} != target {theirs} "
                             f"{getattr(target, theirs)}{why}")
    _validate_layer_ids(cfg.target_layer_ids, target.num_layers)


def _validate_layer_ids(ids: tuple[int, ...], num_layers: int) -> None:
    """DeepSpec ids in {-1} ∪ [0, num_layers-2], distinct. The last layer is excluded (as in
    DeepSpec's eval): extractors disagree on whether its state is raw or final-normed."""
    for i in ids:
        if not -1 <= i <= num_layers - 2:
            raise ValueError(f"target_layer_ids {list(ids)} (DeepSpec count) has {i}, outside "
                             f"[-1, {num_layers - 2}] for a target with {num_layers} layers "
                             "(the final layer is not allowed)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids {list(ids)} repeats a layer")


def _drafter_tensors(tensors: dict[str, torch.Tensor], cfg: DrafterConfig):
    """The checkpoint minus shared and training-only weights (and identity vocab maps)."""
    for name, tensor in tensors.items():
        if name in SHARED_WEIGHTS or name in TRAINING_ONLY:
            continue
        if name in ("t2d", "d2t") and not cfg.uses_draft_vocab:
            if name == "d2t" and bool(tensor.any()):
                raise ValueError("d2t is not the identity map, but draft_vocab_size equals the "
                                 f"target vocab_size {cfg.vocab_size}")
            continue
        yield name, tensor


def _check_shared_shapes(tensors: dict[str, torch.Tensor], cfg: DrafterConfig,
                         target: ModelConfig) -> None:
    """A checkpoint's own embedding / full lm_head copies are ignored, after a shape check."""
    expected = {"embed_tokens.weight": (target.vocab_size, target.hidden_size),
                "lm_head.weight": (cfg.draft_vocab_size, target.hidden_size)}
    for name, shape in expected.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ValueError(f"checkpoint {name} has shape {tuple(tensors[name].shape)}, "
                             f"but the target gives {shape}")


def _check_reduced_lm_head(tensors: dict[str, torch.Tensor], drafter: Drafter) -> None:
    """speculators saves the reduced lm_head; it must be the target rows that t2d selects."""
    saved = tensors.get("lm_head.weight")
    if saved is None or not drafter.config.uses_draft_vocab:
        return
    ours = drafter.draft_lm_head_weight.float()
    saved = saved.to(ours.device).float()             # the tensors load on the CPU, the drafter may not
    if not torch.allclose(saved, ours, atol=1e-2, rtol=1e-2):
        logger.warning("the checkpoint's reduced lm_head differs from the target lm_head rows "
                       "selected by t2d (max |diff| %.3g); using the target's rows",
                       (saved - ours).abs().max().item())


def _required(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"drafter config is missing {key!r}")
    return raw[key]


def read_drafter_config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"drafter path {path!r} does not exist or is not a folder")
    return read_config_json(path, "a drafter checkpoint")


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return {name: t for file in safetensors_files(path) for name, t in load_file(file).items()}
