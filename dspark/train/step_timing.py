"""Training-step throughput: seconds per step and supervised slots per second, with the full
vocabulary and with a reduced draft vocabulary, on the same batches.

    python -m dspark.train.step_timing --data-dir runs/smollm2/data --steps 5 --draft-vocab 8192

The drafters take turns (one step of each, batch after batch), so a change in the load of a shared
machine hits both alike, and medians are compared. Every batch's target features are cached
before the timed steps, as the trainer's feature cache holds them after the first epoch: a timed
step is the drafter's forward, backward and optimiser step plus the teacher's LM-head rows.
The drafters start from the trainer's initialisation (the reduced one a pruned copy of the full
one); their values do not change the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from dspark.models.drafter import Drafter
from dspark.train.features import TargetFeatureExtractor
from dspark.train.forward import supervised_slots, training_forward
from dspark.train.loss import BlockBatch, LossWeights

logger = logging.getLogger(__name__)


@dataclass
class StepTimes:
    seconds: list[float] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        return {"steps": len(self.seconds), "s_per_step": statistics.median(self.seconds),
                "slots_per_s": statistics.median(n / s for n, s in zip(self.slots, self.seconds))}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def training_step(drafter: Drafter, optimizer: torch.optim.Optimizer,
                  extractor: TargetFeatureExtractor, batch: BlockBatch, keys: list,
                  alphas: LossWeights, autocast: bool) -> int:
    """One optimiser step as the trainer takes it (without clipping); returns supervised slots."""
    out, metrics = training_forward(drafter, extractor, batch, alphas, autocast, keys)
    optimizer.zero_grad(set_to_none=True)
    out.total.backward()
    optimizer.step()
    return metrics.supervised_slots


def time_steps(drafters: dict[str, Drafter], extractor: TargetFeatureExtractor,
               batches: list[BlockBatch], steps: int, alphas: LossWeights = LossWeights(),
               autocast: bool = True, warmup: int = 1) -> dict[str, StepTimes]:
    """`warmup + steps` rounds of one step per drafter, cycling over `batches`; the warm-up rounds
    are not timed. The extractor's cache must hold every batch's features."""
    keys = [[("timing", b, i) for i in range(batch.seq_offsets.numel() - 1)]
            for b, batch in enumerate(batches)]
    for batch, k in zip(batches, keys):
        extractor(batch.tokens, batch.seq_offsets, supervised_slots(batch).teacher_rows, k)
    if extractor.cached_bytes == 0:
        raise ValueError("the extractor cached no features: give it a cache budget")
    optimizers = {name: torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-4)
                  for name, d in drafters.items()}
    times = {name: StepTimes() for name in drafters}
    for i in range(warmup + steps):
        b = i % len(batches)
        for name, drafter in drafters.items():
            drafter.train()
            device = drafter.fc.weight.device
            _sync(device)
            start = time.perf_counter()
            slots = training_step(drafter, optimizers[name], extractor, batches[b], keys[b],
                                  alphas, autocast)
            _sync(device)
            if i >= warmup:
                times[name].seconds.append(time.perf_counter() - start)
                times[name].slots.append(slots)
    return times


def main(argv: list[str] | None = None) -> dict:
    from dspark.config import DTYPES
    from dspark.models.loader import load_target
    from dspark.train.data import load_samples
    from dspark.train.loss import build_block_batch
    from dspark.train.prune_vocab import (choose_vocab, coverage, prune_drafter,
                                          response_token_counts)
    from dspark.train.train_config import (TrainConfig, build_drafter_config,
                                           default_target_layer_ids, pick_mask_token_id)
    from dspark.train.trainer import init_drafter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True,
                   help="data shards of `dspark train-draft --generate-data`")
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per drafter")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary size")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    p.add_argument("--batches", type=int, default=4, help="distinct batches the steps cycle over")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--target-dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="no autocast")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.model, DTYPES[args.target_dtype], device=args.device)
    tcfg = target.config
    cfg = TrainConfig(out_dir="", model=args.model, batch_size=args.batch_size,
                      anchors_per_seq=args.anchors, bf16=args.bf16,
                      target_layer_ids=default_target_layer_ids(tcfg.num_layers),
                      mask_token_id=pick_mask_token_id(target.tokenizer, tcfg.vocab_size))
    samples = [s for heldout in (False, True) for s in
               load_samples(args.data_dir, heldout, cfg.max_seq_len, cfg.min_loss_tokens)]
    gen = torch.Generator().manual_seed(cfg.seed)
    groups = [samples[i:i + cfg.batch_size] for i in range(0, len(samples), cfg.batch_size)]
    batches = [build_block_batch([s.tokens for s in g], [s.loss_mask for s in g], cfg.block_size,
                                 cfg.mask_token_id, cfg.anchors_per_seq, gen)
               for g in groups[:args.batches] if len(g) == cfg.batch_size]
    if not batches:
        raise ValueError(f"{args.data_dir!r} holds fewer than {cfg.batch_size} usable responses")
    counts = sum((response_token_counts(args.data_dir, heldout)[0] for heldout in (False, True)),
                 Counter())
    keep = choose_vocab(counts, args.draft_vocab, tcfg.vocab_size, list(tcfg.eos_token_ids))
    full = Drafter(build_drafter_config(cfg, tcfg), target.model.embed_tokens,
                   target.model.lm_head).to(args.device)
    init_drafter(full, cfg.seed)
    drafters = {"full": full, f"draft_{keep.numel()}": prune_drafter(full, keep).to(args.device)}
    extractor = TargetFeatureExtractor(target.model, tcfg, cfg.target_layer_ids, cache_bytes=2**32)
    times = time_steps(drafters, extractor, batches, args.steps, cfg.loss, cfg.bf16, args.warmup)
    result = {"command": "python -m dspark.train.step_timing " + " ".join(argv or []),
              "coverage": coverage(counts, keep), "batches": len(batches),
              **{name: t.summary() for name, t in times.items()}}
    print(f"{'vocabulary':<12} {'s/step':>8} {'slots/s':>9}")
    for name, t in times.items():
        s = t.summary()
        print(f"{name:<12} {s['s_per_step']:>8.3f} {s['slots_per_s']:>9.0f}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
