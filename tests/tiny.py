"""Tiny random target models of every supported family, saved as Hugging Face folders."""

from __future__ import annotations

import json
import os

import torch

FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "llama_rope_llama3": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_rope_linear": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=16),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16),
}


def tiny_config(family: str = "llama", tied: bool = True, vocab: int = 128, **overrides) -> dict:
    cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tied,
               bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    cfg.update(FAMILIES[family])
    cfg.update(overrides)
    return cfg


def hf_model(cfg: dict, seed: int = 0):
    import transformers
    torch.manual_seed(seed)
    config_cls = getattr(transformers, cfg["architectures"][0].replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, cfg["architectures"][0])
    config = config_cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():   # random init is tiny; widen it so logits differ visibly
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    return model


def save_tiny(path: str, family: str = "llama", tied: bool = True, seed: int = 0, **overrides):
    """A random HF model folder (config.json + model.safetensors); returns the HF model."""
    model = hf_model(tiny_config(family, tied, **overrides), seed)
    model.save_pretrained(path)
    return model


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
    os.sync()
