"""`--chat-template`: a Jinja template (a file, or the template itself) replacing the model's."""

from __future__ import annotations

import logging
import os

import jinja2

from dspark.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
JINJA_CHARS = "{}\n"          # what tells an inline template from a mistyped path (as vLLM does)
PROBE = [{"role": "user", "content": "hello"}]


def load_chat_template(value: str) -> str:
    """The template text: the file `value` names, or `value` itself when it reads as a template.
    A path that does not exist is an error here, at start-up, not at the first chat request."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the chat template {value!r}: {exc}") from exc
        logger.info("chat template: %s", value)
        return template
    if any(c in value for c in JINJA_CHARS):
        logger.info("chat template: given inline")
        return value
    raise FileNotFoundError(f"the chat template {value!r} is neither a file nor a Jinja template")


def install_chat_template(tokenizer: Tokenizer | None, template: str) -> None:
    """Make `tokenizer` render chats with `template` (the text `load_chat_template` returned).
    A template that does not compile fails here; one that cannot render a single user message
    is only warned about (a template may rightly insist on, say, a system message first): such
    requests get a 400."""
    if tokenizer is None:
        raise ValueError("--chat-template needs a tokenizer, and this model has none")
    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template(PROBE, add_generation_prompt=True)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not compile (line {exc.lineno}): {exc.message}") from exc
    except ValueError as exc:
        logger.warning("the chat template cannot render a single user message: %s", exc)
