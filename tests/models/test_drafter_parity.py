"""Our drafter against speculators' DSpark model (the reference), fp32, random tiny weights.

speculators' own training forward produces the reference numbers: its `_backbone_forward`
(anchored blocks, flex-style mask rendered dense for eager attention, context injection, final
norm, lm_head) gives the block hidden and base logits; its `forward` then adds the Markov bias
teacher-forced on the true block tokens and runs the confidence head, and we capture both from
the arguments it hands to `compute_metrics`. Our side runs the inference path: project_context,
context_kv, block_forward, then the per-draft Markov / confidence loop fed the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dspark.models.drafter_loader import load_drafter
from dspark.models.model_config import ModelConfig
from dspark.train.export import save_speculators
from tiny import scatter_to_target_vocab, tiny_config

import speculators.models.dspark as spec_dspark  # noqa: E402  (CI installs the reference)
import speculators.models.dspark.core as spec_core  # noqa: E402
import speculators.models.dflash.core as dflash_core  # noqa: E402

VOCAB, HIDDEN, TARGET_LAYERS, ROWS, RANK, MASK = 160, 64, 4, 4, 8, 7
AUX_BOUNDARY_IDS = [1, 2, 3]          # speculators count; DeepSpec ids [0, 1, 2]
SEQ, ANCHORS = 14, (2, 5, 9)


def target_parts(seed: int = 0) -> tuple[ModelConfig, nn.Embedding, nn.Linear]:
    """The target's config and the two modules the drafter shares (random, fp32)."""
    cfg = ModelConfig.from_hf(tiny_config("qwen3", tied=False, vocab=VOCAB,
                                          num_hidden_layers=TARGET_LAYERS))
    g = torch.Generator().manual_seed(seed)
    embed = nn.Embedding(VOCAB, HIDDEN)
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
        lm_head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.1)
    return cfg, embed, lm_head


def vocab_maps(draft_vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """t2d (bool [V]) and d2t (offsets [V_draft]) for a random subset of target ids."""
    keep = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    keep = keep.sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[keep] = True
    return t2d, keep - torch.arange(draft_vocab)


def build_reference(*, sample_from_anchor: bool, draft_vocab: int, head_type: str, rank: int,
                    with_markov: bool, embed: nn.Embedding, lm_head: nn.Linear, seed: int = 2):
    """A speculators DSparkDraftModel with widened random weights and the target's embed/head."""
    from transformers import Qwen3Config
    layer = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
    layer._attn_implementation = "eager"
    cfg = spec_dspark.DSparkSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, block_size=ROWS,
        aux_hidden_state_layer_ids=AUX_BOUNDARY_IDS, mask_token_id=MASK,
        sample_from_anchor=sample_from_anchor, markov_rank=rank, markov_head_type=head_type,
        enable_confidence_head=True, confidence_head_with_markov=with_markov)
    model = spec_dspark.DSparkDraftModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "lm_head", "verifier_")):
                continue
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "markov_w1" in name else 0.08))
        if draft_vocab != VOCAB:
            model.load_vocab_mappings(*vocab_maps(draft_vocab))
            rows = lm_head.weight[model.t2d]
        else:
            rows = lm_head.weight
        model.embed_tokens.weight.copy_(embed.weight)
        model.lm_head.weight.copy_(rows)
        model.verifier_lm_head.weight.copy_(rows)
    return model


def reference_outputs(model, monkeypatch, seed: int = 3) -> dict[str, torch.Tensor]:
    """Run speculators' forward on one packed sequence with anchors fixed by the loss mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, VOCAB, (1, SEQ), generator=g)
    aux = torch.randn(1, SEQ, len(AUX_BOUNDARY_IDS) * HIDDEN, generator=g)
    loss_mask = torch.zeros(1, SEQ, dtype=torch.long)
    loss_mask[0, list(ANCHORS)] = 1      # select_anchors then takes exactly these, sorted
    seen: dict[str, torch.Tensor] = {}
    backbone = model._backbone_forward

    def spy_backbone(*args, **kwargs):
        out = backbone(*args, **kwargs)
        seen["hidden"], seen["base"] = out[0], out[1]
        return out

    def spy_metrics(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"], seen["confidence"] = logits, confidence_logits
        return torch.zeros(()), {}

    monkeypatch.setattr(model, "_backbone_forward", spy_backbone)
    monkeypatch.setattr(spec_core, "compute_metrics", spy_metrics)
    monkeypatch.setattr(dflash_core, "compute_metrics", lambda *a, **k: (torch.zeros(()), {}))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, loss_mask=loss_mask,
              verifier_last_hidden_states=torch.randn(1, SEQ, HIDDEN, generator=g),
              document_ids=torch.zeros(1, SEQ, dtype=torch.long), max_anchors=len(ANCHORS))
    r = len(ANCHORS)
    out = {"ids": ids[0], "aux": aux[0], "hidden": seen["hidden"].view(r, ROWS, -1),
           "base": seen["base"].view(r, ROWS, -1)}
    if "logits" in seen:
        out["logits"] = seen["logits"].view(r, ROWS, -1)
        out["confidence"] = seen["confidence"].view(r, ROWS)
    return out


def run_ours(drafter, ref) -> dict[str, torch.Tensor]:
    """The inference path: context K/V once, one block pass, then the sequential loop."""
    cfg = drafter.config
    anchors = torch.tensor(ANCHORS)
    r, s = len(ANCHORS), cfg.num_block_slots
    with torch.no_grad():
        kv = drafter.context_kv(drafter.project_context(ref["aux"]), torch.arange(SEQ))
        ctx_k = [k.expand(r, -1, -1, -1) for k, _ in kv]
        ctx_v = [v.expand(r, -1, -1, -1) for _, v in kv]
        ctx_valid = torch.arange(SEQ)[None, :] < anchors[:, None]
        block_ids = torch.full((r, s), cfg.mask_token_id)
        block_ids[:, 0] = ref["ids"][anchors]
        positions = anchors[:, None] + torch.arange(s)
        h = drafter.block_forward(block_ids, positions, ctx_k, ctx_v, ctx_valid)
        true_tokens = ref["ids"][positions]                  # x_0 = anchor, then the true block
        hd = drafter.draft_hidden(h)
        state = drafter.init_markov_state(h, true_tokens[:, 0])
        bias, conf = [], []
        for j in range(cfg.block_size):
            e = drafter.markov_embed(true_tokens[:, j]) if drafter.markov_head is not None else None
            if e is not None:
                b, state = drafter.markov_bias(e, hd[:, j], state)
                bias.append(b)
            if drafter.confidence_head is not None:
                conf.append(drafter.confidence_logits(hd[:, j], e))
        return {"hidden": h, "base": drafter.base_logits(h),
                "bias": torch.stack(bias, 1) if bias else None,
                "confidence": torch.stack(conf, 1) if conf else None}


CASES = [  # sample_from_anchor, draft_vocab, head_type, rank, with_markov
    (True, VOCAB, "vanilla", RANK, True),
    (True, 96, "gated", RANK, False),
    (False, VOCAB, "rnn", RANK, True),
    (False, 96, "vanilla", RANK, False),
    (True, 96, "rnn", RANK, False),
    (False, VOCAB, "gated", RANK, True),
    (True, VOCAB, "vanilla", 0, False),
]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("sample_from_anchor,draft_vocab,head_type,rank,with_markov", CASES)
def test_drafter_matches_speculators(tmp_path, monkeypatch, sample_from_anchor, draft_vocab,
                                     head_type, rank, with_markov):
    target, embed, lm_head = target_parts()
    model = build_reference(sample_from_anchor=sample_from_anchor, draft_vocab=draft_vocab,
                            head_type=head_type, rank=rank, with_markov=with_markov,
                            embed=embed, lm_head=lm_head)
    model.save_pretrained(str(tmp_path))
    ref = reference_outputs(model, monkeypatch)
    drafter = load_drafter(str(tmp_path), target, embed, lm_head, torch.float32)
    cfg = drafter.config
    assert cfg.target_layer_ids == tuple(i - 1 for i in AUX_BOUNDARY_IDS)
    assert cfg.num_block_slots == ROWS and cfg.block_size == (ROWS if sample_from_anchor else ROWS - 1)
    ours = run_ours(drafter, ref)

    assert _max_diff(ours["hidden"], ref["hidden"]) <= 1e-4
    assert _max_diff(ours["base"], ref["base"]) <= 1e-4
    drafts = slice(cfg.num_block_slots - cfg.block_size, cfg.num_block_slots)
    if rank:
        ref_bias = (ref["logits"] - ref["base"])[:, drafts]
        assert _max_diff(ours["bias"], ref_bias) <= 1e-4
        assert ours["bias"].abs().max() > 1e-2          # the head is not a no-op
    assert _max_diff(ours["confidence"], ref["confidence"][:, drafts]) <= 1e-4

    # the reduced vocabulary maps back onto the target's own lm_head rows
    full = scatter_to_target_vocab(drafter, ours["base"])
    target_ids = drafter.to_target_ids(torch.arange(draft_vocab))
    assert torch.equal(full[..., target_ids], ours["base"])
    assert torch.isinf(full).sum().item() == full[..., 0].numel() * (VOCAB - draft_vocab)
    with torch.no_grad():
        assert _max_diff(lm_head(ours["hidden"])[..., target_ids], ours["base"]) <= 1e-5
    assert set(drafter.state_dict()) & {"embed_tokens.weight", "lm_head.weight"} == set()


def test_dflash_checkpoint_matches_speculators(tmp_path, monkeypatch):
    """speculators_model_type "dflash": no heads, the 1+γ layout by default."""
    from transformers import Qwen3Config
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    target, embed, lm_head = target_parts()
    layer = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
    layer._attn_implementation = "eager"
    model = DFlashDraftModel(DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=VOCAB, block_size=ROWS,
        aux_hidden_state_layer_ids=AUX_BOUNDARY_IDS, mask_token_id=MASK)).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.08 + (1 if name.endswith("norm.weight") else 0))
        model.embed_tokens.weight.copy_(embed.weight)
        model.lm_head.weight.copy_(lm_head.weight)
        model.verifier_lm_head.weight.copy_(lm_head.weight)
    model.save_pretrained(str(tmp_path))
    ref = reference_outputs(model, monkeypatch)
    drafter = load_drafter(str(tmp_path), target, embed, lm_head, torch.float32)
    assert drafter.markov_head is None and drafter.confidence_head is None
    assert not drafter.config.sample_from_anchor and drafter.config.block_size == ROWS - 1
    ours = run_ours(drafter, ref)
    assert _max_diff(ours["hidden"], ref["hidden"]) <= 1e-4
    assert _max_diff(ours["base"], ref["base"]) <= 1e-4


def test_export_roundtrip_and_speculators_reads_it(tmp_path, monkeypatch):
    """save_speculators -> load_drafter gives identical numbers, and speculators loads it too."""
    target, embed, lm_head = target_parts()
    model = build_reference(sample_from_anchor=False, draft_vocab=96, head_type="rnn", rank=RANK,
                            with_markov=True, embed=embed, lm_head=lm_head)
    model.save_pretrained(str(tmp_path / "ref"))
    ref = reference_outputs(model, monkeypatch)
    first = load_drafter(str(tmp_path / "ref"), target, embed, lm_head, torch.float32)
    save_speculators(first, str(tmp_path / "export"))
    second = load_drafter(str(tmp_path / "export"), target, embed, lm_head, torch.float32)
    a, b = run_ours(first, ref), run_ours(second, ref)
    for key in ("hidden", "base", "bias", "confidence"):
        assert torch.equal(a[key], b[key]), key
    # speculators parses the config and its model takes every saved tensor (its from_pretrained
    # would also fetch the verifier's weights, which a test cannot reach)
    import json
    from safetensors.torch import load_file
    with open(tmp_path / "export" / "config.json") as f:
        config = spec_dspark.DSparkSpeculatorConfig.from_dict(json.load(f))
    config.transformer_layer_config._attn_implementation = "eager"
    reloaded = spec_dspark.DSparkDraftModel(config)
    result = reloaded.load_state_dict(load_file(str(tmp_path / "export" / "model.safetensors")),
                                      strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"embed_tokens.weight", "verifier_lm_head.weight",
                                        "verifier_norm.weight"}
    assert config.sample_from_anchor is False and config.block_size == ROWS
    assert config.speculators_config.proposal_methods[0].speculative_tokens == ROWS - 1
    assert torch.equal(reloaded.markov_head.joint_proj.weight, model.markov_head.joint_proj.weight)
