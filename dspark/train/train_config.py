"""What a training run is: its configuration, saved beside its checkpoint, and the target-dependent
choices it resolves (feature layers, mask token, the drafter's shape, a warm start's architecture).

A run's config is written to `<out>/train_config.json`; rerunning on the same out dir continues
with it, and a checkpoint resumes only under the same architecture fields.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch

from dspark.models.drafter import DrafterConfig
from dspark.models.drafter_loader import drafter_config_from_hf, read_drafter_config
from dspark.models.model_config import ModelConfig
from dspark.train.loss import LossWeights
from dspark.train.schedule import SCHEDULES

CONFIG = "train_config.json"
# fields that shape the drafter or its inputs: a checkpoint only resumes under the same values
ARCH_FIELDS = ("model", "block_size", "num_draft_layers", "markov_rank", "markov_head_type",
               "target_layer_ids", "mask_token_id", "draft_vocab_size")


@dataclass
class TrainConfig:
    out_dir: str
    data_dir: str | None = None            # default <out_dir>/data; held-out evals come from it
    extra_data_dirs: tuple[str, ...] = ()  # more folders whose train splits join data_dir's
    model: str | None = None               # target; None = embedded SmolLM2-135M-Instruct
    target_dtype: str = "bfloat16"
    # drafter (γ drafts per block; layer shapes are copied from the target)
    block_size: int = 7
    num_draft_layers: int = 1
    markov_rank: int = 32
    markov_head_type: str = "vanilla"
    target_layer_ids: tuple[int, ...] | None = None   # None: default_target_layer_ids(n, 5)
    mask_token_id: int | None = None                  # None: pick_mask_token_id
    init_from: str | None = None           # an exported drafter (speculators format) to start from
    grow_layers: int = 0                   # layers added on top of init_from's, starting as identities
    draft_vocab_size: int | None = None    # train in the data's most frequent response tokens
                                           #   (None: the whole vocabulary)
    # optimisation
    lr: float = 6e-4
    weight_decay: float = 0.0
    schedule: str = "wsd"                  # "wsd" (warm-up, stable, decay) or "cosine" (schedule.py)
    warmup_fraction: float = 0.04          # of the first `steps`, when warmup_steps is unset
    warmup_steps: int | None = None        # fixed when the run starts; extending keeps it
    decay_fraction: float = 0.2            # WSD: the last fraction of the final step count decays
    steps: int = 2000
    batch_size: int = 4                    # sequences per step
    anchors_per_seq: int = 32              # blocks per sequence; M <= batch*anchors*γ rows of V
    max_seq_len: int = 640
    min_loss_tokens: int = 8
    grad_clip: float = 1.0
    bf16: bool = True                      # autocast the drafter's matmuls
    feature_cache_gb: float = 6.0          # target features kept in memory for later epochs
    loss: LossWeights = dataclasses.field(default_factory=LossWeights)
    # bookkeeping
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_sequences: int = 64
    checkpoint_every: int = 100

    def __post_init__(self) -> None:
        if isinstance(self.loss, dict):
            self.loss = LossWeights(**self.loss)
        self.extra_data_dirs = tuple(self.extra_data_dirs)
        if self.target_layer_ids is not None:
            self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if min(self.block_size, self.num_draft_layers, self.steps, self.batch_size,
               self.anchors_per_seq) < 1:
            raise ValueError("block_size, num_draft_layers, steps, batch_size and anchors_per_seq "
                             "must all be >= 1")
        if self.grow_layers < 0 or (self.grow_layers and not self.init_from):
            raise ValueError(f"grow_layers adds layers to an --init-from drafter: it needs one "
                             f"and must be >= 0, got {self.grow_layers}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, not {self.schedule!r}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must lie in [0, 1], not {self.decay_fraction}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, not {self.draft_vocab_size}")
        if self.min_loss_tokens < 2:
            raise ValueError("min_loss_tokens must be >= 2: a sequence needs an anchor and a label")

    @property
    def data_path(self) -> str:
        return self.data_dir or os.path.join(self.out_dir, "data")

    @property
    def train_data_paths(self) -> tuple[str, ...]:
        return (self.data_path, *self.extra_data_dirs)


def read_saved_config(out_dir: str) -> dict | None:
    """The resolved TrainConfig a run in `out_dir` started with (None for a new run). A config
    saved before the schedule was a setting belongs to a cosine run, and resumes as one."""
    path = os.path.join(out_dir, CONFIG)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    saved.setdefault("schedule", "cosine")
    return saved


def default_target_layer_ids(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """DFlash's spread round(1 + i(n-4)/(count-1)) (§3.1), e.g. (1, 8, 14, 20, 27) for 30 layers;
    evenly spaced over [0, n-2] where that formula does not fit. Never the last layer."""
    top = num_layers - 2
    if top < 0:
        return (-1,)
    count = max(1, min(count, top + 1))
    if count > 1 and num_layers > 4:
        ids = tuple(int(round(1 + i * (num_layers - 4) / (count - 1))) for i in range(count))
        if len(set(ids)) == count and ids[-1] <= top:
            return ids
    return tuple(sorted({int(round(x)) for x in torch.linspace(0, top, count).tolist()}))


def pick_mask_token_id(tokenizer, vocab_size: int) -> int:
    """The last special token that is not bos/eos/pad (SmolLM2: 16 `<empty_output>`).

    The mask embedding only has to be a fixed, frozen row that never occurs in the data, which is
    what DeepSpec uses too (an unused vocabulary row). A special token is matched only when
    written literally, so chat text and generated responses never contain it. Without a
    tokenizer the last vocabulary row is used."""
    if tokenizer is None:
        return vocab_size - 1
    reserved = {tokenizer.bos_token_id, tokenizer.pad_token_id, *tokenizer.eos_token_ids}
    added = tokenizer.backend.get_added_tokens_decoder()
    candidates = [i for i, tok in added.items() if tok.special and i not in reserved and i < vocab_size]
    return max(candidates) if candidates else vocab_size - 1


def build_drafter_config(cfg: TrainConfig, target: ModelConfig) -> DrafterConfig:
    return DrafterConfig(
        block_size=cfg.block_size, target_layer_ids=tuple(cfg.target_layer_ids),
        sample_from_anchor=True, mask_token_id=cfg.mask_token_id, markov_rank=cfg.markov_rank,
        markov_head_type=cfg.markov_head_type, enable_confidence_head=True,
        confidence_head_with_markov=cfg.markov_rank > 0, hidden_size=target.hidden_size,
        num_layers=cfg.num_draft_layers, num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
        intermediate_size=target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta, rope_scaling=target.rope_scaling, qk_norm=True,
        attention_bias=False, target_hidden_size=target.hidden_size, vocab_size=target.vocab_size,
        draft_vocab_size=target.vocab_size, max_position_embeddings=target.max_position_embeddings)


def init_arch_fields(path: str, target: ModelConfig) -> dict:
    """The TrainConfig architecture fields of the exported drafter in `path`."""
    cfg = drafter_config_from_hf(read_drafter_config(path), target)
    return {"block_size": cfg.block_size, "num_draft_layers": cfg.num_layers,
            "markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
            "target_layer_ids": tuple(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id}
