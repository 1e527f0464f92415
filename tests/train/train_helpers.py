"""Tiny random targets and generated data for the training tests."""

from __future__ import annotations

import os
import textwrap

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


def run_config(run, out: str, **overrides):
    """A TrainConfig small enough for a tiny run's steps to take milliseconds."""
    from dspark.train.train_config import TrainConfig
    fields = dict(out_dir=str(run.root / out), data_dir=run.data, model=run.target,
                  target_dtype="float32", block_size=4, markov_rank=8, steps=8, batch_size=4,
                  anchors_per_seq=8, eval_every=0, log_every=2, checkpoint_every=4, bf16=False,
                  lr=3e-3, mask_token_id=1)
    fields.update(overrides)
    return TrainConfig(**fields)


CHAT_VOCAB = 160
CHAT_SPECIALS = ["<unk>", "<s>", "</s>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}system : be kind<|end|>{% endif %}"
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}")


def chat_words() -> list[str]:
    """ASCII syllable words, the template's own words, and a few that the language and length
    filters must reject (accented words, digits)."""
    own = ["system", "user", "assistant", ":", "be", "kind", "?", "123", "über", "café", "niño"]
    syllables = [c + v + e for c in "bdfgklmnprstv" for v in "aeiou" for e in "nrst"]
    return own + syllables[:CHAT_VOCAB - len(CHAT_SPECIALS) - len(own)]



def tiny_chat_target(path: str) -> str:
    """A tiny random target with a word-level tokenizer and a chat template whose default
    system turn mimics SmolLM2's."""
    import json
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    save_tiny(path, "llama", True, vocab=CHAT_VOCAB, num_hidden_layers=2, seed=3)
    vocab = {token: i for i, token in enumerate(CHAT_SPECIALS + chat_words())}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(CHAT_SPECIALS)
    backend.decoder = decoders.WordPiece(cleanup=False)
    backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>",
                   "add_bos_token": False, "chat_template": CHAT_TEMPLATE}, f)
    return path


FUNCS = textwrap.dedent('''
    """Helpers for weighing parcels."""

    def weigh(parcel, unit="kg"):
        """Return the weight of one parcel in the given unit."""
        total = parcel.mass
        if unit == "g":
            total *= 1000
        return total

    def stack(parcels):
        """Put the parcels on top of each other, heaviest first."""
        ordered = sorted(parcels, key=weigh)
        ordered.reverse()
        return ordered
    ''')


def fake_distribution(site, name: str, module: str) -> None:
    """An installed distribution (dist-info with a RECORD) holding one documented module."""
    info = site / f"{name}-1.0.dist-info"
    (site / module).mkdir(parents=True)
    info.mkdir()
    (site / module / "__init__.py").write_text("")
    (site / module / "core.py").write_text(FUNCS)
    (site / module / "tests").mkdir()
    (site / module / "tests" / "test_core.py").write_text(FUNCS)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                                   f"Summary: Parcels and more parcels.\n")
    files = [f"{module}/__init__.py", f"{module}/core.py", f"{module}/tests/test_core.py",
             f"{name}-1.0.dist-info/METADATA"]
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
