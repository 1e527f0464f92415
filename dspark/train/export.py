"""Write a trained drafter in the speculators DSpark format, the one models/drafter_loader.py
reads back. speculators counts `aux_hidden_state_layer_ids` from the embeddings (0) and its
`block_size` in block rows, where DrafterConfig counts decoder-layer outputs (-1 = embeddings) and
drafts: both are converted here.
"""

from __future__ import annotations

import json
import os
from typing import Any

from dspark.models.drafter import Drafter, DrafterConfig


def save_speculators(drafter: Drafter, path: str, verifier_name_or_path: str | None = None,
                     verifier_architectures: tuple[str, ...] = ()) -> None:
    """Write config.json + model.safetensors in the speculators DSpark format: no shared
    embedding; the lm_head only for a reduced draft vocabulary (runtimes do not rebuild it from
    t2d); the verifier fields name the target, which speculators needs to reload the file."""
    from safetensors.torch import save_file
    cfg = drafter.config
    os.makedirs(path, exist_ok=True)
    tensors = {n: t.detach().contiguous().cpu() for n, t in drafter.state_dict().items()}
    if cfg.uses_draft_vocab:
        if drafter.draft_lm_head_weight.numel() == 0:
            raise ValueError("the reduced-vocabulary drafter has no bound vocabulary maps: set "
                             "t2d/d2t and call bind_draft_vocab() before saving")
        tensors["lm_head.weight"] = drafter.draft_lm_head_weight.detach().contiguous().cpu()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(speculators_config_dict(cfg, str(drafter.fc.weight.dtype).removeprefix("torch."),
                                          verifier_name_or_path, verifier_architectures), f, indent=2)


def speculators_config_dict(cfg: DrafterConfig, dtype: str, verifier_name_or_path: str | None,
                            verifier_architectures: tuple[str, ...]) -> dict[str, Any]:
    rows = cfg.num_block_slots
    layer = {
        "model_type": "qwen3", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias, "hidden_act": "silu",
        "layer_types": ["full_attention"] * cfg.num_layers,
        "rope_parameters": {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})},
    }
    return {
        "architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark",
        "speculators_config": {
            "algorithm": "dspark", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_name_or_path,
                         "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "block_size": rows, "sample_from_anchor": cfg.sample_from_anchor,
        "mask_token_id": cfg.mask_token_id, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size, "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type, "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov,
        "sliding_window_non_causal": False, "dtype": dtype, "tie_word_embeddings": False,
    }
