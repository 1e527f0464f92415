"""Held-out prompts for evaluation and calibration: the draft-training data's held-out split
(prompt tokens before the first response token), or the built-in prompts when none is given."""

from __future__ import annotations

import os


def heldout_prompts(data_dir: str | None, tokenizer, limit: int) -> dict[str, list[list[int]]]:
    """{kind: [prompt token ids]}, kinds "chat" and "code" (code_raw / code_chat fold into code)."""
    if data_dir is None:
        from dspark.bench.prompts import CHAT, CODE
        chat = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                 add_special_tokens=False) for p in CHAT]
        return {"chat": chat[:limit], "code": [tokenizer.encode(p) for p in CODE][:limit]}
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"training data folder {data_dir!r} does not exist")
    from dspark.train.data import load_samples    # the training package reads its own shards
    out: dict[str, list[list[int]]] = {"chat": [], "code": []}
    for sample in load_samples(data_dir, heldout=True):
        kind = "chat" if sample.kind.startswith("chat") else "code"
        first = int(sample.loss_mask.int().argmax())
        if len(out[kind]) < limit and first > 0:
            out[kind].append(sample.tokens[:first].tolist())
    return out
