"""Drafter checkpoints: format detection, the layer-id convention, and a clear error for each
way a checkpoint can disagree with its target."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dspark.models.drafter import Drafter, DrafterConfig
from dspark.models.drafter_loader import load_drafter
from dspark.models.model_config import ModelConfig
from dspark.train.export import save_speculators
from tiny import tiny_config

VOCAB, HIDDEN, TARGET_LAYERS = 128, 64, 4


def target_parts(vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = TARGET_LAYERS):
    cfg = ModelConfig.from_hf(tiny_config("qwen3", tied=False, vocab=vocab, hidden_size=hidden,
                                          num_hidden_layers=layers))
    g = torch.Generator().manual_seed(0)
    embed, lm_head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(vocab, hidden, generator=g))
        lm_head.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.1)
    return cfg, embed, lm_head


def drafter_config(**overrides) -> DrafterConfig:
    fields = dict(block_size=4, target_layer_ids=(0, 1, 2), sample_from_anchor=True,
                  mask_token_id=5, markov_rank=8, markov_head_type="vanilla",
                  enable_confidence_head=True, confidence_head_with_markov=True, hidden_size=HIDDEN,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                  rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, qk_norm=True,
                  attention_bias=False, target_hidden_size=HIDDEN, vocab_size=VOCAB,
                  draft_vocab_size=VOCAB, max_position_embeddings=512)
    fields.update(overrides)
    return DrafterConfig(**fields)


def random_drafter(cfg: DrafterConfig, embed, lm_head, seed: int = 1) -> Drafter:
    drafter = Drafter(cfg, embed, lm_head)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else 0.1 * torch.randn(p.shape, generator=g))
    return drafter


def set_vocab_maps(drafter: Drafter) -> None:
    """Keep every other target id in the draft vocabulary."""
    keep = torch.arange(0, VOCAB, VOCAB // drafter.config.draft_vocab_size)
    drafter.t2d.zero_()
    drafter.t2d[keep] = True
    drafter.d2t.copy_(keep - torch.arange(drafter.config.draft_vocab_size))
    drafter.bind_draft_vocab()


def speculators_checkpoint(path, **overrides) -> str:
    """A random drafter exported in the speculators format (the exporter's parity with
    speculators itself is tested in test_drafter_parity)."""
    _, embed, lm_head = target_parts()
    drafter = random_drafter(drafter_config(**overrides), embed, lm_head)
    if drafter.config.uses_draft_vocab:
        set_vocab_maps(drafter)
    save_speculators(drafter, str(path))
    return str(path)


def edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(file, "w") as f:
        json.dump(cfg, f)


def edit_weights(path: str, drop: str | None = None, add: dict | None = None) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    if drop:
        tensors.pop(drop)
    tensors.update(add or {})
    save_file(tensors, file)


def write_deepspec(path: str, drafter: Drafter, embed, lm_head, num_target_layers: int) -> None:
    """A DeepSpec `Qwen3DSparkModel` folder: the target config copy plus the DSpark fields,
    weights with DeepSpec's own embed_tokens / lm_head copies."""
    cfg = drafter.config
    raw = tiny_config("qwen3", tied=False, vocab=cfg.vocab_size, hidden_size=cfg.hidden_size,
                      num_hidden_layers=cfg.num_layers)
    raw.update(architectures=["Qwen3DSparkModel"], num_target_layers=num_target_layers,
               block_size=cfg.block_size, target_layer_ids=list(cfg.target_layer_ids),
               mask_token_id=cfg.mask_token_id, num_anchors=512,
               enable_confidence_head=cfg.enable_confidence_head,
               confidence_head_with_markov=cfg.confidence_head_with_markov,
               markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
               layer_types=["full_attention"] * cfg.num_layers)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    tensors = {n: t.clone() for n, t in drafter.state_dict().items()}
    tensors["embed_tokens.weight"] = embed.weight.detach().clone()
    tensors["lm_head.weight"] = lm_head.weight.detach().clone()
    save_file(tensors, os.path.join(path, "model.safetensors"))


def draft_numbers(drafter: Drafter, seed: int = 4) -> torch.Tensor:
    """Base logits + Markov bias + confidence for two requests over a short context."""
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    n, r, s = 9, 2, cfg.num_block_slots
    aux = torch.randn(n, len(cfg.target_layer_ids) * cfg.target_hidden_size, generator=g)
    anchors = torch.tensor([4, 9])
    with torch.no_grad():
        kv = drafter.context_kv(drafter.project_context(aux), torch.arange(n))
        block = torch.full((r, s), cfg.mask_token_id)
        block[:, 0] = torch.tensor([11, 12])
        h = drafter.block_forward(block, anchors[:, None] + torch.arange(s),
                                  [k.expand(r, -1, -1, -1) for k, _ in kv],
                                  [v.expand(r, -1, -1, -1) for _, v in kv],
                                  torch.arange(n)[None] < anchors[:, None])
        hd = drafter.draft_hidden(h)
        e = drafter.markov_embed(block[:, 0])
        bias, _ = drafter.markov_bias(e, hd[:, 0], drafter.init_markov_state(h, block[:, 0]))
        conf = drafter.confidence_logits(hd[:, 0], e)
        return torch.cat([drafter.base_logits(hd).flatten(), bias.flatten(), conf])


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_deepspec_format_matches_speculators_format(tmp_path, head_type):
    """Same weights in both formats: identical numbers; the speculators ids are the DeepSpec
    ids + 1 (layer boundaries vs layer outputs), and the -1 (embeddings) id round-trips."""
    target, embed, lm_head = target_parts()
    ids = (-1, 1, 2)
    drafter = random_drafter(drafter_config(target_layer_ids=ids, markov_head_type=head_type),
                             embed, lm_head)
    save_speculators(drafter, str(tmp_path / "spec"))
    with open(tmp_path / "spec" / "config.json") as f:
        assert json.load(f)["aux_hidden_state_layer_ids"] == [0, 2, 3]
    write_deepspec(str(tmp_path / "deepspec"), drafter, embed, lm_head, TARGET_LAYERS)
    a = load_drafter(str(tmp_path / "spec"), target, embed, lm_head, torch.float32)
    b = load_drafter(str(tmp_path / "deepspec"), target, embed, lm_head, torch.float32)
    assert a.config.target_layer_ids == b.config.target_layer_ids == ids
    assert a.config == b.config
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # equal weights, equal numbers up to the GEMM path a tensor's memory layout picks
    torch.testing.assert_close(draft_numbers(a), draft_numbers(b), rtol=0, atol=1e-5)
    torch.testing.assert_close(draft_numbers(a), draft_numbers(drafter), rtol=0, atol=1e-5)


def test_bf16_load_and_reduced_vocab_roundtrip(tmp_path):
    target, embed, lm_head = target_parts()
    cfg = drafter_config(draft_vocab_size=64, sample_from_anchor=False, markov_head_type="gated")
    drafter = random_drafter(cfg, embed, lm_head)
    set_vocab_maps(drafter)
    save_speculators(drafter, str(tmp_path))
    loaded = load_drafter(str(tmp_path), target, embed, lm_head, torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.rotary.cos.dtype == torch.float32
    assert torch.equal(loaded.to_target_ids(torch.tensor([0, 1, 63])), torch.tensor([0, 2, 126]))
    assert (draft_numbers(loaded) - draft_numbers(drafter)).abs().max() < 0.1
    assert loaded.embed_tokens is embed and loaded.lm_head is lm_head
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in loaded.state_dict())


def test_missing_path(tmp_path):
    target, embed, lm_head = target_parts()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_drafter(str(tmp_path / "nope"), target, embed, lm_head, torch.float32)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(str(tmp_path), target, embed, lm_head, torch.float32)


CONFIG_ERRORS = [  # config.json edits -> expected message
    ({"speculators_model_type": None}, "unrecognised drafter config"),
    ({"target_hidden_size": 32}, "target_hidden_size 32 != target hidden_size 64"),
    ({"aux_hidden_state_layer_ids": [1, 2, 4]}, r"has 3, outside \[-1, 2\].*final layer"),
    ({"aux_hidden_state_layer_ids": [-1, 1]}, r"has -2, outside \[-1, 2\]"),
    ({"aux_hidden_state_layer_ids": [1, 1, 2]}, "repeats a layer"),
    ({"block_size": 0}, "block_size 0 .* leaves 0 draft tokens"),
    ({"block_size": 1, "sample_from_anchor": False}, "block_size 1 .* leaves 0 draft tokens"),
    ({"markov_head_type": "lstm"}, "unknown markov_head_type 'lstm'"),
    ({"markov_rank": 0}, "confidence_head_with_markov=True needs a Markov head, but markov_rank is 0"),
    ({"mask_token_id": None}, "missing 'mask_token_id'"),
    ({"mask_token_id": 500}, r"mask_token_id 500 is outside the vocabulary \[0, 128\)"),
]


@pytest.mark.parametrize("changes,message", CONFIG_ERRORS)
def test_config_errors(tmp_path, changes, message):
    path = speculators_checkpoint(tmp_path)
    edit_config(path, **changes)
    target, embed, lm_head = target_parts()
    with pytest.raises(ValueError, match=message):
        load_drafter(path, target, embed, lm_head, torch.float32)


def test_target_mismatch_errors(tmp_path):
    path = speculators_checkpoint(tmp_path)
    target, embed, lm_head = target_parts(vocab=VOCAB + 2)
    with pytest.raises(ValueError, match=f"vocab_size {VOCAB} != target vocab_size {VOCAB + 2}"):
        load_drafter(path, target, embed, lm_head, torch.float32)
    target, embed, lm_head = target_parts(hidden=32)
    with pytest.raises(ValueError, match="target_hidden_size 64 != target hidden_size 32"):
        load_drafter(path, target, embed, lm_head, torch.float32)
    target, embed, lm_head = target_parts(layers=3)       # DeepSpec id 2 is now the last layer
    with pytest.raises(ValueError, match=r"has 2, outside \[-1, 1\] for a target with 3 layers"):
        load_drafter(path, target, embed, lm_head, torch.float32)


def test_drafter_without_confidence_head(tmp_path):
    path = speculators_checkpoint(tmp_path, enable_confidence_head=False,
                                  confidence_head_with_markov=False)
    target, embed, lm_head = target_parts()
    assert load_drafter(path, target, embed, lm_head, torch.float32).confidence_head is None


def test_weight_errors(tmp_path):
    target, embed, lm_head = target_parts()
    path = speculators_checkpoint(tmp_path)
    edit_weights(path, drop="layers.1.mlp.up_proj.weight", add={"extra.bias": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.up_proj.weight'\], "
                                         r"unexpected \['extra.bias'\]"):
        load_drafter(path, target, embed, lm_head, torch.float32)
    path = speculators_checkpoint(tmp_path / "b")
    edit_weights(path, add={"fc.weight": torch.zeros(64, 128)})
    with pytest.raises(ValueError, match=r"fc.weight: checkpoint \(64, 128\) vs expected \(64, 192\)"):
        load_drafter(path, target, embed, lm_head, torch.float32)
    path = speculators_checkpoint(tmp_path / "c", draft_vocab_size=64, vocab_size=VOCAB)
    edit_weights(path, add={"t2d": torch.ones(VOCAB, dtype=torch.bool)})
    with pytest.raises(ValueError, match="vocabulary maps disagree"):
        load_drafter(path, target, embed, lm_head, torch.float32)


def test_deepspec_errors(tmp_path):
    target, embed, lm_head = target_parts()
    drafter = random_drafter(drafter_config(), embed, lm_head)
    write_deepspec(str(tmp_path), drafter, embed, lm_head, TARGET_LAYERS)
    edit_config(str(tmp_path), target_layer_ids=[0, 1, 3])
    with pytest.raises(ValueError, match=r"has 3, outside \[-1, 2\]"):
        load_drafter(str(tmp_path), target, embed, lm_head, torch.float32)
    edit_config(str(tmp_path), target_layer_ids=[0, 1, 2], block_size=0)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        load_drafter(str(tmp_path), target, embed, lm_head, torch.float32)
    edit_config(str(tmp_path), block_size=4)
    edit_weights(str(tmp_path), add={"embed_tokens.weight": torch.zeros(VOCAB, 32)})
    with pytest.raises(ValueError, match=r"embed_tokens.weight has shape \(128, 32\), but the "
                                         r"target gives \(128, 64\)"):
        load_drafter(str(tmp_path), target, embed, lm_head, torch.float32)
