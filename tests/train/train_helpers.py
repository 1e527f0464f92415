"""Tiny random targets and generated data for the training tests."""

from __future__ import annotations

import os

import torch

from dspark.train.data import EncodedPrompt, GenerateConfig, generate_shards
from tiny import save_tiny

VOCAB = 96


def tiny_target(path: str, layers: int = 4) -> str:
    save_tiny(path, "llama", True, vocab=VOCAB, num_hidden_layers=layers)
    return path


def tiny_prompts(num: int, seed: int = 0, heldout_every: int = 5) -> list[EncodedPrompt]:
    """Random token-id prompts (the tiny targets have no tokenizer); every 5th is held out."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        n = int(torch.randint(4, 12, (1,), generator=g))
        ids = torch.randint(3, VOCAB - 1, (n,), generator=g).tolist()
        out.append(EncodedPrompt(f"p{i}", f"p{i}", "chat", i % heldout_every == 0, ids))
    return out


def tiny_engine(target_dir: str):
    """The engine that generates a tiny target's responses."""
    from dspark.llm import LLM
    return LLM(target_dir, dtype="float32", max_num_seqs=16, max_model_len=64, graph="eager")


def generate_tiny_data(target_dir: str, data_dir: str, num: int = 40, max_tokens: int = 32,
                       chunk_size: int = 16) -> GenerateConfig:
    cfg = GenerateConfig(data_dir=data_dir, num_prompts=num, max_tokens=max_tokens,
                         chunk_size=chunk_size, model=target_dir, dtype="float32",
                         temperature=0.7, top_p=0.8)
    generate_shards(tiny_engine(target_dir), tiny_prompts(num), cfg)
    return cfg


def data_exists(data_dir: str) -> bool:
    return os.path.isdir(data_dir) and any(f.startswith("shard_") for f in os.listdir(data_dir))
