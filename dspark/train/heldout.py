"""Held-out prompts of the draft-training data, by kind, for evaluation and calibration."""

from __future__ import annotations

import os

from dspark.train.data import load_samples


def heldout_prompts(data_dir: str, limit: int) -> dict[str, list[list[int]]]:
    """{kind: [prompt token ids]}: the prompt tokens before each held-out response; kinds
    "chat" and "code" (both code variants fold into code)."""
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"training data folder {data_dir!r} does not exist")
    out: dict[str, list[list[int]]] = {"chat": [], "code": []}
    for sample in load_samples(data_dir, heldout=True):
        kind = "chat" if sample.kind.startswith("chat") else "code"
        first = int(sample.loss_mask.int().argmax())
        if len(out[kind]) < limit and first > 0:
            out[kind].append(sample.tokens[:first].tolist())
    return out
