"""Appending sampled tokens to a request: incremental detokenization and every stop condition.

Tokens are appended one at a time, so a step that commits several (speculative decoding) stops
exactly at the first token that ends the request and drops the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dspark.engine.sequence import Sequence
from dspark.outputs import RequestOutput, TokenLogprobs

if TYPE_CHECKING:
    from dspark.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self._offsets: dict[str, tuple[int, int]] = {}

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs] | None = None
               ) -> str | None:
        """Append tokens (with their log-probs, when the request asked) until one finishes the
        request; return the finish reason or None."""
        for i, token in enumerate(tokens):
            seq.output_token_ids.append(token)
            if seq.output_logprobs is not None and logprobs:
                seq.output_logprobs.append(logprobs[i])
            reason = self._check_token(seq, token)
            if self.tokenizer is not None:
                before = len(seq.output_text)
                self._detokenize(seq)
                reason = self._check_stop_strings(seq, before) or reason
            if reason is not None:
                return reason
        return None

    def output(self, seq: Sequence) -> RequestOutput:
        """The request as it stands, with the text and tokens added since the last output. A
        running request's text holds back a tail that may still become a stop string, so what
        was streamed is never taken back."""
        visible = len(seq.output_text)
        if not seq.is_finished:
            visible -= _stop_prefix_len(seq.output_text, seq.params.stop)
        new_text = seq.output_text[seq.sent_text_len:visible]
        new_ids = seq.output_token_ids[seq.sent_token_len:]
        seq.sent_text_len, seq.sent_token_len = max(visible, seq.sent_text_len), seq.num_output_tokens
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            text=seq.output_text, token_ids=list(seq.output_token_ids), finished=seq.is_finished,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, metrics=seq.metrics,
            spec=seq.spec, new_text=new_text, new_token_ids=new_ids,
            logprobs=None if seq.output_logprobs is None else list(seq.output_logprobs),
            prompt_logprobs=None if seq.prompt_logprobs is None else list(seq.prompt_logprobs),
            index=seq.index)

    def release(self, seq: Sequence) -> None:
        self._offsets.pop(seq.request_id, None)

    def _check_token(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        stop = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        if stop and seq.num_output_tokens >= params.min_tokens:   # under min_tokens: a token (as vLLM)
            seq.stop_reason = token
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _detokenize(self, seq: Sequence) -> None:
        """Decode only the tail since the last complete character (prefix/read offsets)."""
        prefix, read = self._offsets.get(seq.request_id, (0, 0))
        ids = seq.output_token_ids
        skip = seq.params.skip_special_tokens
        prefix_text = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=skip)
        full_text = self.tokenizer.decode(ids[prefix:], skip_special_tokens=skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            seq.output_text += full_text[len(prefix_text):]
            self._offsets[seq.request_id] = (read, len(ids))

    def _check_stop_strings(self, seq: Sequence, before: int) -> str | None:
        """A stop string in the new text ends it there (after it with include_stop_str_in_output);
        none counts until more than min_tokens tokens exist (vLLM's rule)."""
        params = seq.params
        if seq.num_output_tokens <= params.min_tokens:
            return None
        for stop in params.stop:
            start = max(0, before - len(stop) + 1)
            index = seq.output_text.find(stop, start)
            if index >= 0:
                end = index + len(stop) if params.include_stop_str_in_output else index
                seq.output_text = seq.output_text[:end]
                seq.stop_reason = stop
                return "stop"
        return None


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
