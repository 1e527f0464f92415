"""The routes beside the OpenAI API that vLLM clients use: /tokenize, /detokenize, /version."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import FastAPI

import dspark
from dspark.server.errors import APIError
from dspark.server.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                    TokenizeResponse)
from dspark.server.unsupported import MESSAGE, refuse_unsupported
from dspark.tokenizer import Tokenizer

if TYPE_CHECKING:
    from dspark.server.api_server import ServerState


def add_extra_routes(app: FastAPI, state: "ServerState") -> None:
    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": dspark.__version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        state.check_model(body.model)
        check_tokenize(body)
        tokenizer = _tokenizer(state, "messages" if body.messages is not None else "prompt")
        ids = await asyncio.to_thread(tokenize_ids, body, tokenizer)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.engine.max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(body.model)
        tokenizer = _tokenizer(state, "tokens")
        check_token_ids(body.tokens, tokenizer.vocab_size)
        # special tokens are kept, as vLLM does, so /tokenize -> /detokenize gives back the prompt
        text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)
        return DetokenizeResponse(prompt=text)


def _tokenizer(state: "ServerState", param: str) -> Tokenizer:
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer", param=param)
    return tokenizer


def check_tokenize(body: TokenizeRequest) -> None:
    """Exactly one of the two forms, and nothing in the messages this server would not honour."""
    if body.prompt is not None and body.messages is not None:
        raise APIError(400, "send either 'prompt' or 'messages', not both", param="messages",
                       code="invalid_value")
    if body.prompt is None and body.messages is None:
        raise APIError(400, "one of 'prompt' or 'messages' is required", param="prompt",
                       code="missing_required_parameter")
    for i, message in enumerate(body.messages or []):
        refuse_unsupported(message, MESSAGE, prefix=f"messages.{i}.")


def tokenize_ids(body: TokenizeRequest, tokenizer: Tokenizer) -> list[int]:
    """A prompt's ids (BOS added unless `add_special_tokens` is false), or a chat's as the chat
    endpoint would feed them (template applied, nothing added unless asked)."""
    if body.messages is None:
        return tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens is not False)
    messages = [m.as_template_input() for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=body.add_generation_prompt is not False)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages", code="chat_template_error") from exc
    return tokenizer.encode(text, add_special_tokens=body.add_special_tokens is True)


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """A 400 naming the first id the tokenizer does not have (decoding would drop it silently)."""
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise APIError(400, f"'tokens[{i}]': token id {token} is out of range; this tokenizer "
                           f"has {vocab_size} tokens (ids 0 to {vocab_size - 1})", param="tokens",
                           code="invalid_value")
