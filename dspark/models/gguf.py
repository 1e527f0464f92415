"""Read a llama.cpp GGUF file into a Hugging Face style config, float32 weights and a tokenizer.

Everything comes out in the same shape as a safetensors checkpoint (HF parameter names, [out, in]
matrices, config.json keys), so the rest of the engine has a single loading path.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from dspark.models.layers.rotary import llama3_inv_freq
from dspark.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _ArchSpec:
    hf_architecture: str
    model_type: str
    permuted_qk: bool  # llama.cpp reorders Q/K rows for its rope layout on llama-style models


SUPPORTED_ARCHITECTURES: dict[str, _ArchSpec] = {
    "llama": _ArchSpec("LlamaForCausalLM", "llama", permuted_qk=True),
    # llama-architecture Mistral files: identical math without sliding window, so load as llama
    "mistral": _ArchSpec("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": _ArchSpec("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    "qwen3": _ArchSpec("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_ROPE_FREQS = "rope_freqs.weight"


@dataclass
class GGUFCheckpoint:
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None


class _FastReader(GGUFReader):
    """GGUFReader slicing a plain ndarray view of its memory map: identical parsing without
    numpy's per-slice memmap bookkeeping, which dominates reading a large vocabulary."""

    def _get(self, offset: int, dtype: Any, count: int = 1,
             override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


def open_reader(path: str) -> GGUFReader:
    """Open lazily (memory-mapped); turn parser failures into one recognisable error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return _FastReader(path)
    except Exception:  # let the stock reader have the final word on what is wrong
        pass
    try:
        return GGUFReader(path)
    except Exception as exc:  # the parser fails with many types on bad input
        raise ValueError(f"{path} is not a valid GGUF file: {exc}") from exc


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value pairs as plain Python values (strings, numbers, lists)."""
    try:
        return {key: fld.contents() for key, fld in reader.fields.items()}
    except Exception as exc:
        raise ValueError(f"{reader.data.filename} is not a valid GGUF file: {exc}") from exc


def load_gguf(path: str) -> GGUFCheckpoint:
    """Dequantize every tensor to float32 and rename it to its Hugging Face parameter."""
    reader = open_reader(path)
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported; "
                         f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    spec = SUPPORTED_ARCHITECTURES[arch]
    names = {t.name for t in reader.tensors}
    tokenizer = _load_tokenizer(meta)
    try:
        config = build_config(meta, names, tokenizer)
    except (KeyError, TypeError) as exc:  # int(None) etc. on an absent key
        raise ValueError(f"GGUF file {path} lacks required {arch} metadata: {exc}") from exc
    tensors = _convert_tensors(path, reader.tensors, config, spec)
    if _ROPE_FREQS in names:
        config["rope_scaling"] = _llama3_scaling(tensors.pop(_ROPE_FREQS), config)
    if "model.embed_tokens.weight" not in tensors:    # CausalLM.load_weights names any other gap
        raise ValueError(f"GGUF file {path} is missing its token embedding (token_embd.weight)")
    # the embedding is authoritative: some files omit {arch}.vocab_size or pad the table
    config["vocab_size"] = int(tensors["model.embed_tokens.weight"].shape[0])
    return GGUFCheckpoint(config=config, tensors=tensors, tokenizer=tokenizer)


def _load_tokenizer(meta: dict[str, Any]) -> Tokenizer | None:
    """A model is still usable with token-id prompts when its tokenizer kind is unsupported."""
    try:
        return Tokenizer.from_gguf_metadata(meta)
    except NotImplementedError as exc:
        logger.warning("no tokenizer loaded: %s", exc)
        return None


def build_config(meta: dict[str, Any], tensor_names: set[str],
                 tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """A config.json dict from `{arch}.*` metadata keys."""
    arch = meta["general.architecture"]
    spec = SUPPORTED_ARCHITECTURES[arch]

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    bos = tokenizer.bos_token_id if tokenizer else meta.get("tokenizer.ggml.bos_token_id")
    eos = tokenizer.eos_token_ids if tokenizer else [meta.get("tokenizer.ggml.eos_token_id")]
    eos = [e for e in eos if e is not None]
    return {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length") or hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch),
        "max_position_embeddings": int(key("context_length", 4096)),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": bos,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    for key, name, cast in (("factor", "factor", float),
                            ("original_context_length", "original_max_position_embeddings", int)):
        if (value := meta.get(f"{arch}.rope.scaling.{key}")) is not None:
            scaling[name] = cast(value)
    return scaling


def _llama3_scaling(freqs: torch.Tensor, config: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.1+ files store the rope scaling as per-frequency divisors, not as metadata: keep
    the Llama 3.x parameter set that reproduces them, refuse anything else."""
    head_dim, theta = config["head_dim"], config["rope_theta"]
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    stored = freqs.double().flatten()
    for original in (8192, 4096, 16384, 32768):
        for factor in dict.fromkeys((float(stored.max()), 8.0, 32.0, 16.0, 4.0)):
            scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": original}
            if torch.allclose(inv / llama3_inv_freq(inv, scaling), stored, rtol=1e-4, atol=1e-4):
                return scaling
    raise ValueError("GGUF rope_freqs.weight does not match llama3 rope scaling; "
                     "this file's position encoding is not supported")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter a GGUF tensor becomes, or None if it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def reverse_qk_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (weight or bias), which interleaves each head's
    [first half | second half] rope layout into pairs, as transformers' GGUF loader does."""
    half = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, half, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def _convert_tensors(path: str, tensors: list[ReaderTensor], config: dict[str, Any],
                     spec: _ArchSpec) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for tensor in tensors:
        name = _ROPE_FREQS if tensor.name == _ROPE_FREQS else hf_tensor_name(tensor.name)
        if name is None:
            unknown.append(tensor.name)
            continue
        weight = _dequantize(path, tensor)
        if spec.permuted_qk and ".attn_q." in tensor.name:
            weight = reverse_qk_permute(weight, config["num_attention_heads"])
        elif spec.permuted_qk and ".attn_k." in tensor.name:
            weight = reverse_qk_permute(weight, config["num_key_value_heads"])
        out[name] = torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))
    if unknown:
        raise ValueError(f"GGUF file {path} has tensors dspark cannot map for this architecture: "
                         f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    return out


def _dequantize(path: str, tensor: ReaderTensor) -> np.ndarray:
    """Float32 values in [out, in] order (GGUF lists dims innermost first)."""
    expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if tensor.data.nbytes != int(tensor.n_bytes):
        raise ValueError(f"{path} is not a valid GGUF file: tensor {tensor.name} is truncated "
                         f"({tensor.data.nbytes} of {int(tensor.n_bytes)} bytes)")
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:
        raise ValueError(f"{path} is not a valid GGUF file: cannot dequantize {tensor.name} "
                         f"({tensor.tensor_type.name}): {exc}") from exc
    values = np.array(values, dtype=np.float32)  # copy: the memory map is read-only
    return values.reshape(expected)
