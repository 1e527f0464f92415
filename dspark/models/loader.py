"""Load a target model from a Hugging Face folder or a GGUF file into our modules."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import torch
from torch import nn

from dspark.config import default_model_path
from dspark.models.layers.rotary import RotaryEmbedding
from dspark.models.llama import CausalLM
from dspark.models.model_config import ModelConfig

if TYPE_CHECKING:                    # the drafter's loader builds through build_on_meta too
    from dspark.models.drafter import DrafterConfig

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
    model = build_on_meta(lambda: CausalLM(cfg, max_positions), cfg,
                          max_positions or cfg.max_position_embeddings, device, dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(weights)
    return model.eval().requires_grad_(False)


M = TypeVar("M", bound=nn.Module)


def build_on_meta(build: Callable[[], M], cfg: ModelConfig | DrafterConfig, positions: int,
                  device: torch.device | str, dtype: torch.dtype) -> M:
    """`build()` on the meta device, then allocated uninitialised on `device`: no random init,
    since every weight comes from the checkpoint. The cos/sin tables are computed, not loaded, so
    they are built for real (fp32: cos_sin casts per call) after the meta pass."""
    with torch.device("meta"):
        module = build()
    module = module.to_empty(device=device).to(dtype)
    module.rotary = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling).to(device)
    return module


def read_config_json(path: str, what: str) -> dict[str, Any]:
    """`path`/config.json; a folder without one is not `what`."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json: not {what}")
    with open(cfg_path) as f:
        return json.load(f)


def _load_hf_folder(path: str, dtype, max_positions, device) -> LoadedTarget:
    cfg = ModelConfig.from_hf(read_config_json(path, "a Hugging Face model folder"))
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
