"""Log-probabilities and echo in the OpenAI shapes: request fields -> SamplingParams, and engine
outputs -> the legacy completions form or the chat form, whole or per streamed chunk.

The engine returns {token id: log-prob} per position (outputs.TokenLogprobs: the chosen token
first, then the top ones). Tokens are shown as their text decoded alone, as vLLM does, so the
text offsets of the completions form count those strings. `echo` with `max_tokens: 0` (how
lm-evaluation-harness scores a text) runs one generated token, which is dropped, so that the
request passes through the engine like any other while returning only its prompt.
"""

from __future__ import annotations

import dataclasses
from itertools import islice
from typing import Any

from dspark.outputs import RequestOutput, TokenLogprobs
from dspark.sampling_params import MAX_LOGPROBS
from dspark.server.errors import APIError
from dspark.server.protocol import (ChatCompletionRequest, ChatLogprobs, ChatTokenLogprob, ChatTopLogprob,
                                    CompletionChoice, CompletionLogprobs, CompletionRequest, SamplingFields)
from dspark.tokenizer import Tokenizer

FLOOR = -9999.0        # -inf is no JSON number: clamped as vLLM does


def prompt_only(req: SamplingFields, max_tokens: int | None) -> bool:
    """`echo` with `max_tokens: 0`: the prompt and its log-probs, nothing generated."""
    return isinstance(req, CompletionRequest) and bool(req.echo) and max_tokens == 0


def logprob_params(req: SamplingFields) -> dict[str, Any]:
    """The SamplingParams fields a request's log-prob fields set (out-of-range values are
    refused by SamplingParams, naming the field, or here for chat's top_logprobs)."""
    if isinstance(req, CompletionRequest):
        if req.logprobs is None:
            return {}
        return {"logprobs": req.logprobs, **({"prompt_logprobs": req.logprobs} if req.echo else {})}
    if isinstance(req, ChatCompletionRequest):
        top = req.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top}",
                           param="top_logprobs", code="invalid_value")
        if top and not req.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs",
                           code="invalid_value")
        return {"logprobs": top or 0} if req.logprobs else {}
    return {}


class TokenText:
    """Each token's text decoded alone (special tokens kept), remembered per request."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = (f"token_id:{token}" if self.tokenizer is None
                    else self.tokenizer.decode([token], skip_special_tokens=False))
            self._cache[token] = text
        return text

    def prompt(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        if self.tokenizer is None:
            return "".join(self(t) for t in output.prompt_token_ids)
        return self.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)


@dataclasses.dataclass
class _Sent:
    tokens: int = 0        # generated tokens whose log-probs went out
    offset: int = 0        # text offset of the next token (the token strings sent, added up)


class CompletionFormat:
    """How the choices of one /v1/completions request show their outputs: the prompt echoed in
    front, the legacy log-probs, the prompt alone for `echo` with `max_tokens: 0`. Keeps, per
    streamed choice, what was sent, so every token's log-probs go out exactly once."""

    def __init__(self, req: CompletionRequest, tokenizer: Tokenizer | None):
        self.echo = bool(req.echo)
        self.logprobs = req.logprobs
        self.prompt_only = prompt_only(req, req.max_tokens)
        self.text = TokenText(tokenizer)
        self._sent: dict[int, _Sent] = {}

    def view(self, output: RequestOutput) -> RequestOutput:
        """The output as the client sees it: without the dropped token of a prompt-only request
        (which ends by length, whatever that token was)."""
        if not self.prompt_only:
            return output
        return dataclasses.replace(output, text="", token_ids=[], new_text="", new_token_ids=[],
                                   logprobs=None if output.logprobs is None else [],
                                   finish_reason="length" if output.finished else None, stop_reason=None)

    def choice(self, index: int, output: RequestOutput) -> CompletionChoice:
        """A finished choice, whole."""
        return self.chunk_choice(index, output.text, output, first=True, sent=_Sent())

    def chunk_choice(self, index: int, text: str, output: RequestOutput, first: bool,
                     sent: _Sent | None = None) -> CompletionChoice:
        """The choice of one streamed chunk: `text` new since the last, the prompt in front of
        the first when echoing, and the log-probs of every token not yet sent."""
        sent = sent if sent is not None else self._sent.setdefault(index, _Sent())
        ids: list[int] = []
        entries: list[TokenLogprobs | None] = []
        if first and self.echo:
            text = self.text.prompt(output) + text
            ids += output.prompt_token_ids
            entries += output.prompt_logprobs or []
        if output.logprobs is not None:
            ids += output.token_ids[sent.tokens:]
            entries += output.logprobs[sent.tokens:]
            sent.tokens = len(output.token_ids)
        logprobs = None if self.logprobs is None else self._legacy(ids, entries, sent)
        final = output.finished
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=output.finish_reason if final else None,
                                stop_reason=output.stop_reason if final else None)

    def _legacy(self, ids: list[int], entries: list[TokenLogprobs | None], sent: _Sent
                ) -> CompletionLogprobs:
        """Text offsets add up the token strings (as vLLM's), whole or streamed alike."""
        tokens = [self.text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(sent.offset)
            sent.offset += len(token)
        return CompletionLogprobs(
            tokens=tokens, text_offset=offsets,
            token_logprobs=[None if e is None else max(e[t], FLOOR) for t, e in zip(ids, entries)],
            top_logprobs=[None if e is None else {self.text(i): max(v, FLOOR) for i, v in e.items()}
                          for e in entries])


class ChatFormat:
    """The chat form of one request's log-probs: per token, its text, log-prob and UTF-8 bytes
    with the `top_logprobs` most likely alternatives; per streamed chunk, the tokens not yet sent."""

    def __init__(self, req: ChatCompletionRequest, tokenizer: Tokenizer | None):
        self.top = (req.top_logprobs or 0) if req.logprobs else None
        self.text = TokenText(tokenizer)
        self._sent = 0

    def whole(self, output: RequestOutput) -> ChatLogprobs | None:
        if self.top is None or output.logprobs is None:
            return None
        return ChatLogprobs(content=[self._token(t, e) for t, e in zip(output.token_ids, output.logprobs)])

    def delta(self, output: RequestOutput) -> ChatLogprobs | None:
        """The log-probs of the tokens added since the last chunk (one choice per chat request)."""
        if self.top is None or output.logprobs is None:
            return None
        start, self._sent = self._sent, len(output.token_ids)
        pairs = zip(output.token_ids[start:], output.logprobs[start:])
        return ChatLogprobs(content=[self._token(t, e) for t, e in pairs])

    def _token(self, token: int, entry: TokenLogprobs) -> ChatTokenLogprob:
        ranked = sorted(entry.items(), key=lambda item: -item[1])      # the chosen one was first
        return ChatTokenLogprob(**self._top(token, entry[token]).model_dump(),
                                top_logprobs=[self._top(i, v) for i, v in islice(ranked, self.top)])

    def _top(self, token: int, logprob: float) -> ChatTopLogprob:
        text = self.text(token)
        return ChatTopLogprob(token=text, logprob=max(logprob, FLOOR), bytes=list(text.encode("utf-8")))
