"""Drafter training: model construction, the loop, held-out eval, checkpoints, export (the run's
configuration is train_config.py).

The recipe is DeepSpec's (reference/dspark_algorithm.md §5.3-5.4) scaled to a 2-core CPU: AdamW,
grad-norm clip 1.0, bf16 autocast, the target frozen and run on the fly; the learning rate follows
a warm-up-stable-decay schedule (schedule.py). Every `checkpoint_every` steps the whole training
state (weights, optimizer, step, RNG states, the sampler's epoch order and cursor) is written
atomically to `<out>/checkpoint.pt`, and a Trainer built on the same out dir continues from it: an
interrupted job resumes by rerunning it, and a run given more steps or more data continues with
its optimiser state and its place in the schedule and the epoch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

from dspark.config import DTYPES
from dspark.models.drafter import Drafter
from dspark.models.drafter_loader import load_drafter
from dspark.models.loader import LoadedTarget, load_target
from dspark.train.data import EpochSampler, Sample, atomic_save, load_samples, load_train_samples
from dspark.train.export import save_speculators
from dspark.train.features import TargetFeatureExtractor
from dspark.train.forward import MetricPool, StepMetrics, training_forward
from dspark.train.loss import LossOutput, build_block_batch
from dspark.train.prune_vocab import choose_vocab, coverage, data_counts, full_vocab_state, prune_drafter
from dspark.train.schedule import check_resume, lr_factor, resolve_warmup_steps
from dspark.train.train_config import (ARCH_FIELDS, CONFIG, TrainConfig, build_drafter_config,
                                       default_target_layer_ids, init_arch_fields,
                                       pick_mask_token_id)

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
LOG = "train_log.jsonl"


def init_drafter(drafter: Drafter, seed: int) -> None:
    """Module defaults, except the Markov bias starts at zero (W2 = 0) so the untrained head does
    not add noise to the base logits; W1 still gets gradient once W2 has moved."""
    torch.manual_seed(seed)
    for module in drafter.modules():
        if hasattr(module, "reset_parameters") and module is not drafter:
            module.reset_parameters()
    if drafter.markov_head is not None:
        torch.nn.init.zeros_(drafter.markov_head.markov_w2.weight)


class Trainer:
    """Owns the frozen target, the drafter being trained, the data and the training state."""

    def __init__(self, cfg: TrainConfig, target: LoadedTarget | None = None, load_data: bool = True):
        os.makedirs(cfg.out_dir, exist_ok=True)
        saved = self._read_checkpoint(cfg.out_dir)
        if saved is not None and cfg.model is None:
            cfg = dataclasses.replace(cfg, model=saved["config"]["model"])
        self.target = target or load_target(cfg.model, DTYPES[cfg.target_dtype])
        tcfg = self.target.config
        self.cfg = self._resolve(cfg, saved)
        self.drafter_config = build_drafter_config(self.cfg, tcfg)
        self.drafter = Drafter(self.drafter_config, self.target.model.embed_tokens,
                               self.target.model.lm_head)
        init_drafter(self.drafter, self.cfg.seed)
        if saved is None and self.cfg.init_from:
            self._init_from(self.cfg.init_from)
        if self.cfg.draft_vocab_size:
            self.drafter = self._reduced(self.drafter, saved)
            self.drafter_config = self.drafter.config
        self.extractor = TargetFeatureExtractor(self.target.model, tcfg, self.cfg.target_layer_ids,
                                                cache_bytes=int(self.cfg.feature_cache_gb * 2**30))
        self.train_samples: list[Sample] = []
        self.sample_keys: list[str] = []     # folder + uid: where each sequence is after a resume
        self.eval_samples: list[Sample] = []
        if load_data:
            paths = self.cfg.train_data_paths
            for path, samples in zip(paths, load_train_samples(paths, self.cfg.max_seq_len,
                                                               self.cfg.min_loss_tokens)):
                self.train_samples += samples
                self.sample_keys += [f"{os.path.realpath(path)}:{s.uid}" for s in samples]
            self.eval_samples = load_samples(self.cfg.data_path, True, self.cfg.max_seq_len,
                                             self.cfg.min_loss_tokens)[:self.cfg.eval_sequences]
        self.sampler = EpochSampler(len(self.train_samples), self.cfg.seed) if load_data else None
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.cfg.lr,
                                           weight_decay=self.cfg.weight_decay)
        self.anchor_gen = torch.Generator().manual_seed(self.cfg.seed)
        self.step = 0
        self._warn_mask_in_data()
        if saved is not None:
            self._load_state(saved)
        with open(os.path.join(self.cfg.out_dir, CONFIG), "w") as f:
            json.dump(asdict(self.cfg), f, indent=2)
        logger.info("drafter: %d trainable parameters, %d train / %d held-out sequences",
                    sum(p.numel() for p in self.params), len(self.train_samples),
                    len(self.eval_samples))

    # ---- configuration -------------------------------------------------------------------------

    @staticmethod
    def _read_checkpoint(out_dir: str) -> dict | None:
        path = os.path.join(out_dir, CHECKPOINT)
        return torch.load(path, weights_only=True) if os.path.isfile(path) else None

    def _resolve(self, cfg: TrainConfig, saved: dict | None) -> TrainConfig:
        """Fill the target-dependent defaults; a checkpoint's architecture must match (a run
        started `init_from` a drafter has that drafter's, whatever the config's defaults say)."""
        tcfg = self.target.config
        cfg = dataclasses.replace(cfg)
        if saved is not None:
            old = TrainConfig(**saved["config"])
            for name in ARCH_FIELDS:
                new = getattr(cfg, name)
                if new is not None and new != getattr(old, name) and not (old.init_from and name != "model"):
                    raise ValueError(f"{cfg.out_dir} holds a checkpoint with {name}="
                                     f"{getattr(old, name)!r}, not {new!r}; use another --out")
                setattr(cfg, name, getattr(old, name))
        elif cfg.init_from:
            for name, value in init_arch_fields(cfg.init_from, tcfg).items():
                setattr(cfg, name, value)
            cfg.num_draft_layers += cfg.grow_layers
        if cfg.warmup_steps is None:      # fixed at the run's start, kept by every resume
            first = TrainConfig(**saved["config"]) if saved is not None else cfg
            cfg.warmup_steps = resolve_warmup_steps(first.warmup_steps, first.warmup_fraction,
                                                    first.steps)
        if cfg.target_layer_ids is None:
            cfg.target_layer_ids = default_target_layer_ids(tcfg.num_layers)
        if cfg.mask_token_id is None:
            cfg.mask_token_id = pick_mask_token_id(self.target.tokenizer, tcfg.vocab_size)
        return cfg

    def _init_from(self, path: str) -> None:
        """Start a new run from an exported drafter's weights (a warm start on more data or with a
        new schedule); `_resolve` gave the run its architecture. A drafter with a reduced draft
        vocabulary seeds the full one (`full_vocab_state`): training needs every token's row."""
        source = load_drafter(path, self.target.config, self.target.model.embed_tokens, self.target.model.lm_head,
                              torch.float32)
        state = source.state_dict()
        if source.config.uses_draft_vocab:
            state = full_vocab_state(source)
            logger.warning("--init-from %s has a reduced draft vocabulary (%d of %d tokens): the "
                           "Markov rows of the other tokens start at zero", path,
                           source.config.draft_vocab_size, source.config.vocab_size)
        if self.cfg.grow_layers:
            state = grown_state(state, source.config.num_layers, self.cfg.num_draft_layers)
            logger.info("added %d layers on top of the %d of %s", self.cfg.grow_layers,
                        source.config.num_layers, path)
        self.drafter.load_state_dict(state)
        logger.info("initialised the drafter from %s", path)

    def _reduced(self, drafter: Drafter, saved: dict | None) -> Drafter:
        """The drafter in a reduced draft vocabulary: its LM head, Markov rows and teacher over
        the data's most frequent response tokens only (train/forward.py). A resumed run keeps
        the vocabulary its checkpoint holds (its maps are in the saved state)."""
        size = self.cfg.draft_vocab_size
        if saved is not None:
            return Drafter(dataclasses.replace(drafter.config, draft_vocab_size=size),
                           self.target.model.embed_tokens, self.target.model.lm_head)
        counts = data_counts(self.cfg.data_path, self.cfg.extra_data_dirs)
        keep = choose_vocab(counts.train, size, self.target.config.vocab_size,
                            sorted(self.target.config.eos_token_ids))
        logger.info("draft vocabulary of %d tokens: coverage %.2f%% on %s, %.2f%% on %s", size,
                    100 * coverage(counts.train, keep), counts.train_source,
                    100 * coverage(counts.heldout, keep), counts.heldout_source)
        return prune_drafter(drafter, keep)

    def _warn_mask_in_data(self) -> None:
        hits = sum(int((s.tokens == self.cfg.mask_token_id).sum()) for s in self.train_samples)
        if hits:
            logger.warning("mask token %d occurs %d times in the training data",
                           self.cfg.mask_token_id, hits)

    # ---- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"format": 2, "step": self.step, "config": asdict(self.cfg),
                "drafter_config": asdict(self.drafter_config),
                "model": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                "sampler": self.sampler.state_dict() if self.sampler else None,
                "sample_keys": self.sample_keys,
                "rng": {"torch": torch.get_rng_state(), "anchor": self.anchor_gen.get_state()}}

    def save_checkpoint(self) -> str:
        path = os.path.join(self.cfg.out_dir, CHECKPOINT)
        atomic_save(self.state_dict(), path)
        return path

    def _load_state(self, saved: dict) -> None:
        self.drafter.load_state_dict(saved["model"])
        if self.drafter.config.uses_draft_vocab:
            self.drafter.bind_draft_vocab()          # its LM-head rows follow the loaded maps
        self.optimizer.load_state_dict(saved["optimizer"])
        check_resume(saved["step"], _schedule_settings(saved["config"]),
                     _schedule_settings(asdict(self.cfg)))
        if self.sampler is not None:
            self.sampler.load_state_dict(saved["sampler"], self._old_to_new(saved))
        torch.set_rng_state(saved["rng"]["torch"])
        self.anchor_gen.set_state(saved["rng"]["anchor"])
        self.step = saved["step"]
        self._truncate_log(self.step)
        logger.info("resumed from %s at step %d", self.cfg.out_dir, self.step)

    def _old_to_new(self, saved: dict) -> list[int | None] | None:
        """Where each sequence the checkpoint was trained on is now (None: no longer loaded);
        None for a checkpoint without sequence keys, which resumes on unchanged data only."""
        if "sample_keys" not in saved:
            return None
        index = {key: i for i, key in enumerate(self.sample_keys)}
        return [index.get(key) for key in saved["sample_keys"]]

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        return cfg.lr * lr_factor(step, cfg.steps, cfg.warmup_steps, cfg.schedule, cfg.decay_fraction)

    def _truncate_log(self, step: int) -> None:
        """Records written after the checkpoint will be written again: drop them."""
        path = os.path.join(self.cfg.out_dir, LOG)
        if not os.path.isfile(path):
            return
        with open(path) as f:
            keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        with open(path, "w") as f:
            f.writelines(keep)

    def log(self, record: dict) -> None:
        with open(os.path.join(self.cfg.out_dir, LOG), "a") as f:
            f.write(json.dumps(record) + "\n")

    # ---- steps ---------------------------------------------------------------------------------

    def _batch(self, samples: list[Sample], generator: torch.Generator):
        return build_block_batch([s.tokens for s in samples], [s.loss_mask for s in samples],
                                 self.cfg.block_size, self.cfg.mask_token_id,
                                 self.cfg.anchors_per_seq, generator)

    def train_step(self) -> tuple[LossOutput, StepMetrics, float]:
        """One optimiser step on the next batch; returns the loss, the metrics and the grad norm
        (before clipping)."""
        indices = self.sampler.next_batch(self.cfg.batch_size)
        batch = self._batch([self.train_samples[i] for i in indices], self.anchor_gen)
        self.drafter.train()
        out, metrics = training_forward(self.drafter, self.extractor, batch, self.cfg.loss,
                                        self.cfg.bf16, [("train", i) for i in indices])
        self.optimizer.zero_grad(set_to_none=True)
        out.total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.optimizer.step()
        self.step += 1
        return out, metrics, float(grad_norm)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss, per-slot acceptance and τ; the same anchors every time (fixed seed),
        so successive evals are comparable."""
        if not self.eval_samples:
            return {}
        self.drafter.eval()
        gen = torch.Generator().manual_seed(self.cfg.seed + 1)
        pool = MetricPool(self.cfg.block_size)
        for lo in range(0, len(self.eval_samples), self.cfg.batch_size):
            batch = self._batch(self.eval_samples[lo:lo + self.cfg.batch_size], gen)
            keys = [("eval", i) for i in range(lo, lo + batch.seq_offsets.numel() - 1)]
            pool.add(*training_forward(self.drafter, self.extractor, batch, self.cfg.loss,
                                       self.cfg.bf16, keys))
        return pool.summary()

    def train(self, use_tqdm: bool = True, stop_at: int | None = None) -> dict:
        """Run to `cfg.steps` (or stop early at `stop_at`, on the same schedule, with a
        checkpoint), logging, evaluating and checkpointing; returns the last eval."""
        cfg, last_eval = self.cfg, {}
        end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
        window, busy, start = MetricPool(cfg.block_size), 0.0, time.perf_counter()
        grad_norms: list[float] = []
        if self.step == 0 and cfg.init_from and cfg.eval_every:
            last_eval = self._log_eval()           # the warm start's baseline, at step 0
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", disable=not use_tqdm)
        while self.step < end:
            t0 = time.perf_counter()
            out, metrics, grad_norm = self.train_step()
            busy += time.perf_counter() - t0          # throughput excludes eval and checkpoints
            window.add(out, metrics)
            grad_norms.append(grad_norm)
            bar.update(1)
            if self.step % cfg.log_every == 0 or self.step == end:
                record = self._train_record(window, grad_norms, busy, time.perf_counter() - start)
                self.log(record)
                bar.set_postfix_str(_postfix(record))
                window, busy, grad_norms = MetricPool(cfg.block_size), 0.0, []
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                last_eval = self._log_eval()
            if self.step % cfg.checkpoint_every == 0 or self.step == end:
                self.save_checkpoint()
        bar.close()
        return last_eval

    def _log_eval(self) -> dict:
        result = self.evaluate()
        if result:
            self.log({"type": "eval", "step": self.step, **result})
            logger.info("eval step %d: loss %.4f tau %.3f accept %s", self.step, result["loss"],
                        result["tau"], result["accept"])
        return result

    def _train_record(self, window: MetricPool, grad_norms: list[float], seconds: float,
                      elapsed: float) -> dict:
        summary = window.summary()
        steps = len(grad_norms)
        return {"type": "train", "step": self.step, "epoch": self.sampler.epoch,
                "lr": self.lr_at(self.step - 1), "grad_norm": sum(grad_norms) / steps,
                "step_s": seconds / steps, "tok_s": summary["tokens"] / seconds,
                "slots_s": summary["slots"] / seconds, "elapsed_s": elapsed, **summary}

    # ---- export --------------------------------------------------------------------------------

    def export(self, path: str, dtype: torch.dtype = torch.bfloat16) -> str:
        """Write the speculators format (what `load_drafter` and the engine read)."""
        copy = Drafter(self.drafter_config, self.target.model.embed_tokens, self.target.model.lm_head)
        copy.load_state_dict(self.drafter.state_dict())
        if copy.config.uses_draft_vocab:
            copy.bind_draft_vocab()
        copy = copy.to(dtype)
        name = self.cfg.model or "HuggingFaceTB/SmolLM2-135M-Instruct"
        save_speculators(copy, path, verifier_name_or_path=name,
                         verifier_architectures=(self.target.config.architecture,))
        logger.info("exported the drafter to %s (%s)", path, dtype)
        return path

    def write_card(self, path: str) -> str:
        """The model card (README.md, curves PNG) for an exported drafter in `path`."""
        from dspark.train.card import write_model_card
        keep = torch.nonzero(self.drafter.t2d).flatten().cpu() if self.drafter_config.uses_draft_vocab else None
        return write_model_card(path, self.cfg.out_dir, self.cfg, self.drafter_config,
                                sum(p.numel() for p in self.params), keep)


def _schedule_settings(config: dict) -> dict:
    """A config's schedule fields; a checkpoint from before they existed held a cosine run."""
    cfg = TrainConfig(**{"schedule": "cosine", **config})
    return {"schedule": cfg.schedule, "steps": cfg.steps, "decay_fraction": cfg.decay_fraction,
            "warmup_steps": resolve_warmup_steps(cfg.warmup_steps, cfg.warmup_fraction, cfg.steps)}


def _postfix(record: dict) -> str:
    acc = "/".join(f"{a:.2f}" for a in record["accept"])
    return (f"loss {record['loss']:.3f} acc {acc} tau {record['tau']:.2f} "
            f"tok/s {record['tok_s']:.0f}")


def grown_state(state: dict[str, torch.Tensor], layers: int, grown: int) -> dict[str, torch.Tensor]:
    """A drafter's state with layers added on top, each a copy of its last layer whose output
    projections are zero: every new layer adds nothing to the residual stream, so the grown
    drafter starts as exactly its source and a warm start on more capacity loses nothing."""
    last = f"layers.{layers - 1}."
    out = dict(state)
    for i in range(layers, grown):
        for key, value in state.items():
            if key.startswith(last):
                zero = key.endswith(("o_proj.weight", "down_proj.weight"))
                out[f"layers.{i}.{key[len(last):]}"] = torch.zeros_like(value) if zero else value.clone()
    return out
