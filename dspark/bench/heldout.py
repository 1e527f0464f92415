"""Evaluation and calibration prompts by kind: the built-in chat and code prompts."""

from __future__ import annotations


def builtin_prompts(tokenizer, limit: int) -> dict[str, list[list[int]]]:
    """{kind: [prompt token ids]}; chat prompts go through the chat template, code ones raw."""
    from dspark.bench.prompts import CHAT, CODE
    chat = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                             add_special_tokens=False) for p in CHAT]
    return {"chat": chat[:limit], "code": [tokenizer.encode(p) for p in CODE][:limit]}

