"""Load a target model from a Hugging Face folder or a GGUF file into our modules."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from dspark.models.layers.rotary import RotaryEmbedding
from dspark.models.llama import CausalLM
from dspark.models.model_config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class LoadedTarget:
    model: CausalLM
    config: ModelConfig
    tokenizer: "Tokenizer | None"  # noqa: F821


def load_target(path: str | None, dtype: torch.dtype = torch.bfloat16,
                max_positions: int | None = None, device: str = "cpu") -> LoadedTarget:
    """`path` is a model folder or a .gguf file; None means the embedded default."""
    if path is None:
        from dspark.models.gguf import default_model_path
        path = default_model_path()
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if os.path.isfile(path):
        from dspark.models.gguf import load_gguf
        ckpt = load_gguf(path)
        cfg = ModelConfig.from_hf(ckpt.config)
        return LoadedTarget(_build(cfg, ckpt.tensors.items(), dtype, max_positions, device), cfg, ckpt.tokenizer)
    return _load_hf_folder(path, dtype, max_positions, device)


def _build(cfg: ModelConfig, weights, dtype: torch.dtype, max_positions: int | None,
           device: str) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # the cos/sin tables are computed, not loaded: build them for real after the meta pass
    model.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                   cfg.rope_theta, cfg.rope_scaling).to(device)
    model.load_weights(weights)
    return model.eval().requires_grad_(False)


def _load_hf_folder(path: str, dtype, max_positions, device) -> LoadedTarget:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json: not a Hugging Face model folder")
    with open(cfg_path) as f:
        cfg = ModelConfig.from_hf(json.load(f))
    model = _build(cfg, _safetensors_weights(path), dtype, max_positions, device)
    tokenizer = None
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        from dspark.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_folder(path)
    else:
        logger.warning("%s has no tokenizer.json: only token-id prompts will work", path)
    return LoadedTarget(model, cfg, tokenizer)


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path!r} holds no .safetensors weights")
    return [os.path.join(path, f) for f in files]


def _safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open
    for file in safetensors_files(path):
        if not os.path.isfile(file):
            raise FileNotFoundError(f"weight shard {file!r} listed in the index does not exist")
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"{file!r} is not a valid safetensors file: {e}") from e
