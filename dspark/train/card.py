"""The model card an exported drafter ships with: what it was trained on, how, and how well.

Everything in it is read from the run (its config, log and data manifest), so the card cannot
drift from the checkpoint it describes. Engine measurements (τ in real decoding, speed-up, STS)
come from `dspark bench` and `dspark calibrate` and are appended by whoever runs them.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import torch

from dspark.config import default_model_path
from dspark.train.data import MANIFEST, Sample, load_samples, load_train_samples
from dspark.train.plot import read_log
from dspark.train.prune_vocab import coverage_note, data_counts
from dspark.train.schedule import describe_schedule

CURVES = "training_curves.png"
_CE_LABELS = {"sampled": "on the response tokens", "argmax": "on the target's argmax"}


def _data_section(data_dirs: tuple[str, ...], train: list[list[Sample]], max_len: int,
                  min_loss_tokens: int) -> list[str]:
    """One table row per split and folder: training reads every folder's train split (`train`),
    the held-out evals read the first folder's held-out split."""
    lines = ["| data | split | sequences | chat / code | response tokens | all tokens |",
             "|---|---|---|---|---|---|"]
    splits = [(i, "train", samples) for i, samples in enumerate(train)]
    splits.append((0, "held-out", load_samples(data_dirs[0], True, max_len, min_loss_tokens)))
    for i, name, samples in splits:
        kinds = Counter("chat" if s.kind == "chat" else "code" for s in samples)
        loss = sum(int(s.loss_mask.sum()) for s in samples)
        total = sum(s.tokens.numel() for s in samples)
        lines.append(f"| {chr(ord('A') + i)} | {name} | {len(samples)} | {kinds['chat']} / "
                     f"{kinds['code']} | {loss} | {total} |")
    lines.append("")
    for i, data_dir in enumerate(data_dirs):
        with open(os.path.join(data_dir, MANIFEST)) as f:
            pinned = json.load(f)["pinned"]
        lines.append(f"{chr(ord('A') + i)}: responses sampled from the target at temperature "
                     f"{pinned['temperature']}, top-p {pinned['top_p']}, at most "
                     f"{pinned['max_tokens']} tokens, prompts of at most "
                     f"{pinned['max_prompt_tokens']} tokens.")
    lines += ["", "Prompt sources: docs/training_data.md."]
    return lines


def _eval_table(record: dict) -> list[str]:
    gamma = len(record["accept"])
    head = "| | " + " | ".join(str(k + 1) for k in range(gamma)) + " | τ |"
    rule = "|---" * (gamma + 2) + "|"
    rows = [f"| acceptance 1 − TV (T = 1) | " + " | ".join(f"{a:.3f}" for a in record["accept"])
            + f" | {record['tau']:.2f} |",
            f"| argmax match (T = 0) | " + " | ".join(f"{a:.3f}" for a in record["greedy_match"])
            + f" | {record['tau_greedy']:.2f} |"]
    return [head, rule, *rows]


def _baseline(evals: list[dict]) -> str:
    """What the warm start's own weights scored on the same held-out slots (the step-0 eval)."""
    first = evals[0] if evals and evals[0]["step"] == 0 else None
    if first is None:
        return ""
    return (f" Those weights, on the held-out slots below before any step: loss "
            f"{first['loss']:.3f}, τ {first['tau']:.2f} (T = 1) and {first['tau_greedy']:.2f} "
            f"(argmax match).")


def _progress_table(train: list[dict], evals: list[dict], batch_size: int, num_train: int) -> list[str]:
    """Held-out τ at every eval against what the run had trained on by then: target tokens
    (the log's, a step logged twice after a restart counted once) and training sequences."""
    tokens_at = {r["step"]: r["tokens"] for r in train}                # the last record of a step
    lines = ["| step | target tokens trained on | training sequences drawn (distinct) | "
             "τ (T = 1) | τ (argmax match) |", "|---|---|---|---|---|"]
    for e in evals:
        tokens = sum(t for step, t in tokens_at.items() if step <= e["step"])
        drawn = e["step"] * batch_size
        lines.append(f"| {e['step']} | {tokens} | {drawn} ({min(drawn, num_train)}) | "
                     f"{e['tau']:.3f} | {e['tau_greedy']:.3f} |")
    return lines


def write_model_card(export_dir: str, run_dir: str, cfg, drafter_config, num_params: int,
                     keep: torch.Tensor | None = None) -> str:
    """README.md (and the curves PNG, if plotted) into `export_dir`; `keep` [V_draft]: the target
    ids of a draft vocabulary the run trained in, whose coverage the card reports."""
    train, evals = read_log(os.path.join(run_dir, "train_log.jsonl"))
    samples = load_train_samples(cfg.train_data_paths, cfg.max_seq_len, cfg.min_loss_tokens)
    last = evals[-1] if evals else None
    steps = train[-1]["step"] if train else 0
    seconds = sum(r["step_s"] * cfg.log_every for r in train)
    lines = [
        f"# DSpark drafter for {os.path.basename(cfg.model) if cfg.model else 'SmolLM2-135M-Instruct'}", "",
        f"A {drafter_config.num_layers}-layer DSpark drafter (block size γ = {cfg.block_size}, "
        f"{cfg.markov_head_type} Markov head of rank {cfg.markov_rank}, confidence head) for "
        f"{cfg.model or 'the embedded ' + os.path.basename(default_model_path())}, in the speculators "
        f"format. {num_params / 1e6:.1f}M trainable parameters; embeddings and LM head are the "
        f"target's (frozen, not stored). Context features: target layers "
        f"{list(cfg.target_layer_ids)}; mask token {cfg.mask_token_id}.", "",
        "## Data", "", *_data_section(cfg.train_data_paths, samples, cfg.max_seq_len, cfg.min_loss_tokens), "",
        "## Training", "",
        f"`dspark train-draft`: {steps} steps of {cfg.batch_size} sequences × {cfg.anchors_per_seq} "
        f"anchor blocks, AdamW lr {cfg.lr} ({describe_schedule(cfg)}), grad clip "
        f"{cfg.grad_clip}, {'bf16 autocast' if cfg.bf16 else 'fp32'}, loss {cfg.loss.ce} CE "
        f"({_CE_LABELS[cfg.loss.ce_labels]}) + {cfg.loss.l1} L1 + "
        f"{cfg.loss.conf} BCE with position weights exp(−k/{cfg.loss.decay:g}); "
        f"{seconds / 3600:.1f} h of step time on a 2-core CPU.", ""]
    if cfg.init_from:
        grown = f", with {cfg.grow_layers} layer{'s' * (cfg.grow_layers > 1)} added on top" if cfg.grow_layers else ""
        lines += [f"The run started from the weights of an earlier export "
                  f"(`{os.path.basename(os.path.normpath(cfg.init_from))}`, `--init-from`{grown}); the "
                  f"steps above are this run's alone.{_baseline(evals)}", ""]
    if last:
        lines += [f"Held-out ({last['slots']} supervised slots, step {last['step']}): loss "
                  f"{last['loss']:.3f}, per-position acceptance and τ (1 + Σ cumulative products):",
                  "", *_eval_table(last), ""]
    if len(evals) > 1:
        num_train = sum(map(len, samples))
        lines += ["Held-out τ against what the run had trained on (this run's steps only):", "",
                  *_progress_table(train, evals, cfg.batch_size, num_train), ""]
    curves = os.path.join(run_dir, CURVES)
    if os.path.isfile(curves):
        shutil.copyfile(curves, os.path.join(export_dir, CURVES))
        lines += [f"![training curves]({CURVES})", ""]
    if keep is not None:
        lines.append(coverage_note(data_counts(cfg.data_path, cfg.extra_data_dirs), keep, drafter_config.vocab_size,
                                   f"dspark train-draft --draft-vocab {keep.numel()}"))
    path = os.path.join(export_dir, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path
