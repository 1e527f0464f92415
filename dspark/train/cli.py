"""`dspark train-draft`: generate data, train, export and plot, each step resumable.

    dspark train-draft --out runs/smollm2 --generate-data --num-prompts 4000
    dspark train-draft --out runs/smollm2 --steps 3000            # trains; rerun to resume
    dspark train-draft --out runs/smollm2 --resume --steps 5000 --extra-data-dir runs/more/data
    dspark train-draft --out runs/smollm2 --export dspark/assets/smollm2-135m-instruct-dspark --plot

Actions run in the order generate -> train -> plot -> export (with its model card); with none of them given, the
command trains. Every long action picks up where an interrupted run of it stopped.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:      # the heavy modules load only when a command runs
    from dspark.train.data import GenerateConfig
    from dspark.train.train_config import TrainConfig
    from dspark.train.trainer import Trainer

logger = logging.getLogger(__name__)


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="run directory: checkpoint, log, plots (and data)")
    p.add_argument("--data-dir", default=None, help="data shards (default: <out>/data)")
    p.add_argument("--extra-data-dir", dest="extra_data_dirs", action="append", default=None,
                   metavar="DIR", help="another data folder whose train split joins the first's, less "
                                       "what the first holds out (repeatable)")
    p.add_argument("--model", default=None, help="target HF folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: with other jobs on the same two cores, two "
                        "threads measured 7x slower per step; use 2 on an idle machine)")
    act = p.add_argument_group("actions (generate, train, plot, export; default: --train)")
    act.add_argument("--generate-data", action="store_true", help="generate the target's responses")
    act.add_argument("--train", action="store_true", help="train (continues from <out>/checkpoint.pt)")
    act.add_argument("--resume", action="store_true",
                     help="train, and fail if there is no checkpoint; with more --steps or another "
                          "--extra-data-dir the run goes on with its optimiser state, its place in "
                          "the schedule and the epoch (extend before the decay starts)")
    act.add_argument("--export", metavar="PATH", default=None, help="write the speculators format")
    act.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    act.add_argument("--plot", action="store_true", help="write <out>/training_curves.png")
    gen = p.add_argument_group("data generation")
    gen.add_argument("--num-prompts", type=int, default=4000)
    gen.add_argument("--prompt-source", default="local",
                     choices=["local", "self", "docs", "code-requests", "chat-requests"],
                     help="local: standard-library code and handwritten topics; self: user turns "
                          "the target writes itself (single and multi-turn) and the code of "
                          "installed packages; docs: chat requests about installed packages' "
                          "prose; code-requests / chat-requests: coding / everyday requests the "
                          "target writes after a fixed opening (docs/training_data.md)")
    gen.add_argument("--max-tokens", type=int, default=192, help="response length cap")
    gen.add_argument("--temperature", type=float, default=0.2,
                     help="the target's recommended sampling (SmolLM2: 0.2, top-p 0.9)")
    gen.add_argument("--top-p", type=float, default=0.9)
    gen.add_argument("--heldout-fraction", type=float, default=0.05)
    gen.add_argument("--chat-fraction", type=float, default=0.5)
    gen.add_argument("--chunk-size", type=int, default=256, help="prompts per shard")
    gen.add_argument("--max-num-seqs", type=int, default=64, help="engine batch while generating")
    gen.add_argument("--heldout-only", action="store_true",
                     help="generate only the held-out split (for bench --data or calibrate on a "
                          "machine without the run's data; a later run without it adds the rest)")
    tr = p.add_argument_group("training (unset: the run's saved value, else the default)")
    for flag, field, kind, help_text in TRAIN_FLAGS:
        tr.add_argument(flag, dest=field, type=kind, default=None, help=help_text)
    tr.add_argument("--markov-type", dest="markov_head_type", default=None,
                    choices=["vanilla", "gated", "rnn"])
    tr.add_argument("--schedule", default=None, choices=["wsd", "cosine"],
                    help="learning-rate schedule: wsd (warm-up, constant, decay over the last "
                         "--decay of the steps; the default) or cosine")
    tr.add_argument("--target-layer-ids", default=None,
                    help="comma-separated target layer outputs (default: 5 spread, not the last)")
    tr.add_argument("--init-from", default=None, metavar="DRAFTER",
                    help="start a new run from this exported drafter's weights and architecture "
                         "(a reduced draft vocabulary's dropped tokens start with zero Markov rows)")
    tr.add_argument("--ce-labels", default=None, choices=["sampled", "argmax"],
                    help="CE on the response's tokens (sampled, the default) or the target's argmax")
    tr.add_argument("--no-bf16", dest="bf16", action="store_const", const=False, default=None,
                    help="train in fp32 (slower on CPU)")


# (flag, TrainConfig field, type, help)
TRAIN_FLAGS = (
    ("--block-size", "block_size", int, "γ, drafts per block (7)"),
    ("--draft-layers", "num_draft_layers", int, "drafter layers (1)"),
    ("--grow-layers", "grow_layers", int,
     "with --init-from: add this many layers on top, each starting as an identity (0)"),
    ("--markov-rank", "markov_rank", int, "Markov head rank r (32)"),
    ("--mask-token-id", "mask_token_id", int, "mask token (a special token of the target)"),
    ("--steps", "steps", int, "optimiser steps (2000)"),
    ("--batch-size", "batch_size", int, "sequences per step (4)"),
    ("--anchors", "anchors_per_seq", int, "blocks per sequence (32)"),
    ("--draft-vocab", "draft_vocab_size", int,
     "train in a reduced draft vocabulary of this many tokens, the data's most frequent (default: all)"),
    ("--lr", "lr", float, "peak learning rate (6e-4)"),
    ("--warmup", "warmup_fraction", float, "warm-up fraction of the first --steps (0.04)"),
    ("--warmup-steps", "warmup_steps", int, "warm-up steps (default: from --warmup; fixed at start)"),
    ("--decay", "decay_fraction", float, "wsd: decaying fraction of the final steps (0.2)"),
    ("--grad-clip", "grad_clip", float, "grad-norm clip (1.0)"),
    ("--max-seq-len", "max_seq_len", int, "truncate sequences to this many tokens (640)"),
    ("--seed", "seed", int, "seed (0)"),
    ("--log-every", "log_every", int, "steps per log record (10)"),
    ("--eval-every", "eval_every", int, "steps between held-out evals (200)"),
    ("--eval-sequences", "eval_sequences", int, "held-out sequences per eval (64)"),
    ("--checkpoint-every", "checkpoint_every", int, "steps between checkpoints (100)"),
    ("--feature-cache-gb", "feature_cache_gb", float,
     "memory for target features reused by later epochs (6; 0 reruns the target every step)"),
)


def generate_config(args) -> GenerateConfig:
    from dspark.train.data import GenerateConfig
    return GenerateConfig(
        data_dir=args.data_dir or os.path.join(args.out, "data"), num_prompts=args.num_prompts,
        seed=args.seed or 0, heldout_fraction=args.heldout_fraction,
        chat_fraction=args.chat_fraction, max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, chunk_size=args.chunk_size,
        max_num_seqs=args.max_num_seqs, model=args.model, threads=args.threads,
        heldout_only=args.heldout_only, prompt_source=args.prompt_source)


def train_config(args) -> TrainConfig:
    """TrainConfig defaults, overridden by the run's saved config, overridden by explicit flags,
    so rerunning a bare `--out DIR` continues with the settings the run started with."""
    from dspark.train.train_config import ARCH_FIELDS, TrainConfig, read_saved_config
    fields = {"out_dir": args.out}
    saved = read_saved_config(args.out) or {}
    fields.update({k: v for k, v in saved.items() if k != "out_dir"})
    explicit = {field: getattr(args, field) for _, field, _, _ in TRAIN_FLAGS}
    explicit["markov_head_type"] = args.markov_head_type
    explicit["schedule"] = args.schedule
    explicit["bf16"] = args.bf16
    explicit["data_dir"] = args.data_dir
    explicit["extra_data_dirs"] = args.extra_data_dirs and tuple(args.extra_data_dirs)
    explicit["model"] = args.model
    if args.target_layer_ids:
        explicit["target_layer_ids"] = tuple(int(x) for x in args.target_layer_ids.split(","))
    if args.init_from:              # the draft vocabulary is the run's own: the drafter seeds every row
        arch = [k for k in ARCH_FIELDS if k not in ("model", "draft_vocab_size") and explicit.get(k) is not None]
        if arch:
            raise ValueError(f"--init-from takes the architecture from the drafter; drop the "
                             f"flags for {arch}")
        explicit["init_from"] = args.init_from
    as_json = {k: list(v) if isinstance(v, tuple) else v for k, v in explicit.items()}
    changed = {k: (saved[k], v) for k, v in explicit.items()
               if v is not None and k in saved and saved[k] != as_json[k]}
    if changed:
        logger.warning("overriding the run's saved settings (saved, new): %s", changed)
    fields.update({k: v for k, v in explicit.items() if v is not None})
    if args.ce_labels is not None:
        fields["loss"] = {**dict(fields.get("loss") or {}), "ce_labels": args.ce_labels}
    return TrainConfig(**fields)


def run_train(args) -> None:
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    train = args.train or args.resume or not (args.generate_data or args.export or args.plot)
    if args.generate_data:
        from dspark.train.data import generate_data
        count = generate_data(generate_config(args))
        print(f"generated {count} responses into {generate_config(args).data_dir}")
    trainer = None
    if train or args.export:
        trainer = _trainer(args, train)
    if train:
        result = trainer.train()
        if result:
            print(f"step {trainer.step}: held-out loss {result['loss']:.4f}, τ {result['tau']:.3f}, "
                  f"acceptance per slot {result['accept']}")
    if args.plot:
        from dspark.train.plot import plot_training
        from dspark.train.trainer import LOG
        print(f"wrote {plot_training(os.path.join(args.out, LOG))}")
    if args.export:
        dtype = torch.bfloat16 if args.export_dtype == "bfloat16" else torch.float32
        print(f"exported to {trainer.export(args.export, dtype)} (step {trainer.step})")
        print(f"wrote {trainer.write_card(args.export)}")


def _trainer(args, train: bool) -> Trainer:
    from dspark.train.trainer import CHECKPOINT, Trainer
    has_checkpoint = os.path.isfile(os.path.join(args.out, CHECKPOINT))
    if (args.resume or (args.export and not train)) and not has_checkpoint:
        raise FileNotFoundError(f"{args.out} has no {CHECKPOINT} to resume or export from")
    return Trainer(train_config(args), load_data=train)     # export only: no data loaded
