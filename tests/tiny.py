"""Tiny random target models of every supported family, saved as Hugging Face folders."""

from __future__ import annotations

import json
import os
import random

import torch

FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "llama_rope_llama3": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_rope_linear": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=16),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16),
}


def tiny_config(family: str = "llama", tied: bool = True, vocab: int = 128, **overrides) -> dict:
    cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tied,
               bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    cfg.update(FAMILIES[family])
    cfg.update(overrides)
    return cfg


def hf_model(cfg: dict, seed: int = 0):
    import transformers
    torch.manual_seed(seed)
    config_cls = getattr(transformers, cfg["architectures"][0].replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, cfg["architectures"][0])
    config = config_cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():   # random init is tiny; widen it so logits differ visibly
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    return model


def save_tiny(path: str, family: str = "llama", tied: bool = True, seed: int = 0, **overrides):
    """A random HF model folder (config.json + model.safetensors); returns the HF model."""
    model = hf_model(tiny_config(family, tied, **overrides), seed)
    model.save_pretrained(path)
    return model


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
    os.sync()


def scatter_to_target_vocab(drafter, logits: torch.Tensor) -> torch.Tensor:
    """[..., V_draft] -> [..., V] with -inf outside the drafter's draft vocabulary."""
    if not drafter.config.uses_draft_vocab:
        return logits
    out = logits.new_full((*logits.shape[:-1], drafter.config.vocab_size), float("-inf"))
    return out.index_copy_(-1, drafter.draft_to_target_index, logits)


def save_random_drafter(path: str, target_dir: str, gamma: int = 4, markov_type: str = "vanilla",
                        rank: int = 8, sample_from_anchor: bool = True, layer_ids=(0, 1, 2),
                        confidence: bool = True, num_layers: int = 1, seed: int = 0, std: float = 0.08,
                        copy_prev: float = 0.0):
    """A random DSpark drafter for the tiny target in `target_dir`, saved in speculators format.

    copy_prev > 0 makes a vanilla Markov head (rank = vocab) that favours repeating the previous
    token, so drafts of the repetitive text random targets produce are often accepted.
    """
    from dspark.models.drafter import Drafter, DrafterConfig
    from dspark.models.loader import load_target
    from dspark.train.export import save_speculators
    target = load_target(target_dir, torch.float32)
    t = target.config
    if copy_prev:
        markov_type, rank = "vanilla", t.vocab_size
    cfg = DrafterConfig(
        block_size=gamma, target_layer_ids=tuple(layer_ids), sample_from_anchor=sample_from_anchor,
        mask_token_id=t.vocab_size - 1, markov_rank=rank, markov_head_type=markov_type,
        enable_confidence_head=confidence, confidence_head_with_markov=confidence and rank > 0,
        hidden_size=t.hidden_size, num_layers=num_layers, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, intermediate_size=t.intermediate_size,
        rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta, rope_scaling=None, qk_norm=True,
        attention_bias=False, target_hidden_size=t.hidden_size, vocab_size=t.vocab_size,
        draft_vocab_size=t.vocab_size, max_position_embeddings=t.max_position_embeddings)
    torch.manual_seed(seed)
    drafter = Drafter(cfg, target.model.embed_tokens, target.model.lm_head)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() > 1:
                p.normal_(0, std)
        if copy_prev:
            eye = torch.eye(t.vocab_size) * copy_prev ** 0.5
            drafter.markov_head.markov_w1.weight.copy_(eye)
            drafter.markov_head.markov_w2.weight.copy_(eye)
    save_speculators(drafter, path)
    return drafter


def run_staggered(llm, prompts, params, seed: int = 1) -> list[list[int]]:
    """Submit requests a few at a time between engine steps; token ids in submission order."""
    rng, engine, pending = random.Random(seed), llm.engine, list(zip(prompts, params))
    ids, done = {}, {}
    while pending or engine.has_unfinished:
        for _ in range(rng.randrange(0, 3)):
            if pending:
                p, sp = pending.pop(0)
                ids[engine.add_request(p, sp)] = len(ids)
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
    return [done[i] for i in range(len(prompts))]


def greedy_workload(n: int, vocab: int, seed: int = 0, max_out: int = 40):
    """n random token-id prompts (2-29 tokens) with greedy params of 1..max_out-1 tokens."""
    from dspark import SamplingParams
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab - 1) for _ in range(rng.randrange(2, 30))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, max_out), ignore_eos=True)
              for _ in range(n)]
    return prompts, params


def pin_flat_costs(policy) -> None:
    """Drafts priced as free: the policy then drafts for every request and verifies every
    draft, whatever this machine measured at start-up for a tiny model (a measured table
    decides by timing, and the tests must speculate to test it)."""
    from dspark.spec.planner import CostTable
    policy.table = CostTable(fingerprint={}, verify_ms=[0.0] + [10.0] * policy.table.max_tokens,
                             draft_ms=[0.0] + [1e-6] * policy.table.max_requests)
    policy.min_gain = 0.0


def speculating(llm):
    """`llm` with its speculation policy (if any) pinned to verify every draft (pin_flat_costs)."""
    if llm.engine.policy is not None:
        pin_flat_costs(llm.engine.policy)
    return llm


def share_kernels(cache_home) -> None:
    """The compiled CPU kernels under `cache_home` are the ones already built (they depend on the
    sources alone): a private cache folder must not make a test, or a server a test launches,
    compile them again for minutes."""
    import pathlib

    from dspark.kernels import cpu as cpu_kernels
    built = cpu_kernels.cache_dir()
    built.mkdir(parents=True, exist_ok=True)
    link = pathlib.Path(cache_home) / "dspark" / "kernels"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(built.resolve(), target_is_directory=True)
