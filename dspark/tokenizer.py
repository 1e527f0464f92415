"""Text <-> token ids and chat prompts, from a Hugging Face folder or a GGUF file's metadata.

One thin wrapper over `tokenizers.Tokenizer` serves both sources, so the engine never needs
transformers at run time. The BOS token is always added here rather than by the inner
post-processor, so a tokenizer.json whose template also adds one cannot double it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL = 3
_USER_DEFINED = 4

# Split patterns llama.cpp applies for a few `tokenizer.ggml.pre` values; the byte-level step
# then runs without its own regex. Same patterns as transformers' GGUF tokenizer conversion.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_PLAIN_BYTE_LEVEL_PRE = {None, "default", "gpt2", "gpt-2"}
_warned_pre: set[str] = set()


@dataclass
class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token facts the engine and chat template need."""

    backend: BackendTokenizer
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in `text` are always matched; `add_special_tokens` only adds BOS."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render the prompt the way transformers does, so prompts match the model's training."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; pass a plain prompt instead")
        template = _compile_template(self.chat_template)
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **extra}
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **context)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed to render: {exc}") from exc

    @classmethod
    def from_folder(cls, path: str) -> "Tokenizer":
        """Load tokenizer.json and the special tokens/chat template scattered over the side files."""
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"tokenizer.json not found in {path!r}")
        backend = BackendTokenizer.from_file(tok_path)
        config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
        bos_id = _special_id(backend, config.get("bos_token"), "bos_token")
        eos_ids = _unique([_special_id(backend, config.get("eos_token"), "eos_token"),
                           *_generation_eos_ids(path)])
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:
            add_bos = _post_processor_adds_bos(backend, bos_id)
        return cls(backend=backend, bos_token_id=bos_id, eos_token_ids=eos_ids,
                   pad_token_id=_special_id(backend, config.get("pad_token"), "pad_token"),
                   add_bos=add_bos, chat_template=_folder_chat_template(path, config))

    @classmethod
    def from_gguf_metadata(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """Build from `tokenizer.*` GGUF keys (plain values or gguf `ReaderField`s)."""
        meta = {k: _plain(v) for k, v in fields.items() if k.startswith("tokenizer.")}
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise NotImplementedError(
                f"GGUF tokenizer model {kind!r} is not supported; only 'gpt2' (byte-level BPE) is")
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        backend = _byte_level_bpe(meta)
        eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        return cls(
            backend=backend,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_unique([meta.get(f"tokenizer.ggml.{k}") for k in eos_keys]),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )


# ---- chat template ---------------------------------------------------------------------------

def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Jinja's own tojson escapes HTML characters, which templates written for transformers don't expect."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Templates come from model files, i.e. untrusted: always the sandbox, configured like transformers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# ---- Hugging Face folder ----------------------------------------------------------------------

def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """Special tokens are spelled either as a string or as a serialized AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _special_id(backend: BackendTokenizer, value: Any, what: str) -> int | None:
    content = _token_content(value)
    if content is None:
        return None
    token_id = backend.token_to_id(content)
    if token_id is None:
        logger.warning("%s %r is not in the vocabulary; ignoring it", what, content)
    return token_id


def _generation_eos_ids(path: str) -> list[int]:
    """generation_config.json often lists extra end tokens (e.g. end-of-turn) the config omits."""
    gen = _read_json(os.path.join(path, "generation_config.json")) or {}
    eos = gen.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def _post_processor_adds_bos(backend: BackendTokenizer, bos_id: int | None) -> bool:
    """Without an explicit add_bos_token flag, trust whatever tokenizer.json's template does."""
    if bos_id is None:
        return False
    with_special = backend.encode("x", add_special_tokens=True).ids
    without = backend.encode("x", add_special_tokens=False).ids
    return with_special[:1] == [bos_id] and without[:1] != [bos_id]


def _folder_chat_template(path: str, config: dict[str, Any]) -> str | None:
    """Newer exports keep the template in its own file; those win over tokenizer_config.json."""
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    from_json = _read_json(os.path.join(path, "chat_template.json"))
    if isinstance(from_json, dict) and from_json.get("chat_template"):
        return _pick_template(from_json["chat_template"])
    return _pick_template(config.get("chat_template"))


def _pick_template(value: Any) -> str | None:
    """A template may be a list of named variants; the engine only needs the default one."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


# ---- GGUF metadata ----------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    return value.contents() if hasattr(value, "contents") else value


def _unique(ids: list[int | None]) -> list[int]:
    out: list[int] = []
    for token_id in ids:
        if token_id is not None and int(token_id) not in out:
            out.append(int(token_id))
    return out


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_bpe(meta: dict[str, Any]) -> BackendTokenizer:
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # a few converters store raw text for some tokens; BPE needs them in the byte alphabet
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    except Exception as exc:  # tokenizers raises a bare Exception on inconsistent merges
        raise ValueError(f"GGUF tokenizer vocabulary and merges disagree: {exc}") from exc
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(backend, tokens, types, alphabet)
    return backend


def _add_gguf_special_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int],
                             alphabet: set[str]) -> None:
    """Control tokens must be matched whole (and skippable on decode) or they'd be split into bytes.

    A "control" token spelled outside the byte alphabet is a known converter mislabel; adding it
    would grow the vocabulary past the embedding table, so it is skipped (as transformers does).
    """
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= alphabet]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """Reproduce the pre-tokenizer the vocabulary was trained with; merges are wrong without it."""
    if pre == "smollm":
        # as in SmolLM2's tokenizer.json: every digit on its own, then GPT-2 byte level
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre not in _PLAIN_BYTE_LEVEL_PRE and pre not in _warned_pre:
        _warned_pre.add(pre)
        logger.warning("GGUF pre-tokenizer %r is not known; using plain GPT-2 byte-level "
                       "splitting, which may tokenize some text differently", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
