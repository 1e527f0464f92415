"""Request fields that would change the answer but are not implemented: refused, never ignored.

Clients often send such a field at its neutral value (`length_penalty: 1.0`, `echo: false`,
`tool_choice: "none"`), which asks for exactly what the server does, so only a value that would
change the output is refused, with a 400 naming the field. Fields this server does not know at
all are logged once per name: they are accepted (OpenAI clients send many that change nothing
for a local model) but an operator can see what clients expect.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from dspark.server.errors import APIError, printable

logger = logging.getLogger(__name__)

Neutral = Callable[[Any], bool]


def _is(*values: Any) -> Neutral:
    """Equal to one of `values` (a bool never stands for 0 or 1)."""
    return lambda v: any(v == x and isinstance(v, bool) == isinstance(x, bool) for x in values)


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


_NONE: Neutral = lambda v: v is None          # noqa: E731
_FALSE = _is(None, False)

# field -> (neutral value test, what is missing)
SHARED: dict[str, tuple[Neutral, str]] = {
    "length_penalty": (_is(None, 1, 1.0), "beam search is not implemented"),
    "use_beam_search": (_FALSE, "beam search is not implemented"),
    "bad_words": (_empty, "bad_words is not implemented"),
    "allowed_token_ids": (_NONE, "allowed_token_ids is not implemented"),
    "truncate_prompt_tokens": (_NONE, "prompt truncation is not implemented"),
    "prompt_logprobs": (_NONE, "prompt log-probabilities are returned only through 'echo' with "
                               "'logprobs' on /v1/completions"),
    "spaces_between_special_tokens": (_is(None, True), "special tokens are always decoded as is"),
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        "only plain text responses are implemented"),
    "guided_json": (_NONE, "guided decoding is not implemented"),
    "guided_regex": (_NONE, "guided decoding is not implemented"),
    "guided_choice": (_NONE, "guided decoding is not implemented"),
    "guided_grammar": (_NONE, "guided decoding is not implemented"),
    "structured_outputs": (_NONE, "structured outputs are not implemented"),
}

COMPLETION: dict[str, tuple[Neutral, str]] = {
    "suffix": (_empty, "insertion (suffix) is not implemented"),
    "add_special_tokens": (_is(None, True), "completion prompts are always tokenized with special "
                                            "tokens"),
}

CHAT: dict[str, tuple[Neutral, str]] = {
    "echo": (_FALSE, "echoing the prompt is not implemented"),
    "tools": (_empty, "tool calling is not implemented"),
    "tool_choice": (_is(None, "none", "auto"), "tool calling is not implemented"),
    "functions": (_empty, "function calling is not implemented"),
    "function_call": (_is(None, "none", "auto"), "function calling is not implemented"),
    "chat_template": (_NONE, "a per-request chat template is not supported"),
    "chat_template_kwargs": (_empty, "chat template arguments are not supported"),
    "continue_final_message": (_FALSE, "continuing the final message is not implemented"),
    "documents": (_empty, "documents are not supported"),
    "add_special_tokens": (_FALSE, "chat prompts are tokenized as the template writes them"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported"),
    "audio": (_NONE, "audio output is not supported"),
    "reasoning_effort": (_NONE, "reasoning effort is not supported"),
}

MESSAGE: dict[str, tuple[Neutral, str]] = {
    "tool_calls": (_empty, "tool calls in messages are not supported"),
    "tool_call_id": (_NONE, "tool results in messages are not supported"),
}

_logged_unknown: set[str] = set()


def refuse_unsupported(body: BaseModel, table: dict[str, tuple[Neutral, str]], prefix: str = "") -> None:
    """A 400 naming the first field set to a value this server would not honour."""
    for name, (neutral, what) in table.items():
        if not neutral(getattr(body, name, None)):
            param = f"{prefix}{name}"
            raise APIError(400, f"'{param}' is not supported by this server: {what}", param=param,
                           code="unsupported_parameter")


def log_unknown(body: BaseModel, where: str) -> None:
    """Fields the request model does not declare: logged once per name for the server's life."""
    for name in body.model_extra or {}:
        key = f"{where}.{name}"
        if key not in _logged_unknown:
            _logged_unknown.add(key)
            logger.warning("ignoring the unknown field '%s' of %s (logged once)", printable(name), where)
