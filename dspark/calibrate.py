"""`dspark calibrate`: record the confidence head on held-out prompts and fit STS.

One temperature per position is fitted left to right on the cumulative product (earlier
temperatures frozen), minimising the expected calibration error of a_k against the prefix-accept
labels. A head can also be biased: trained on teacher-forced blocks of sampled data, it may
predict acceptance 0.5 where greedy decoding of other prompts accepts 0.4. A temperature cannot
move σ(z / T) across 0.5, so an offset b_k per position is fitted with it (spec/sts.py applies
both).
"""

from __future__ import annotations

import logging

import torch

from dspark.llm import LLM
from dspark.sampling_params import SamplingParams
from dspark.spec.sts import STSCalibration, survival

logger = logging.getLogger(__name__)

GRID = torch.logspace(-3, 3, 121, base=2.0)        # temperatures 0.125 .. 8
OFFSETS = torch.arange(-40, 41) / 10.0              # logit offsets -4 .. 4, 0.1 apart


def run_calibration(llm: LLM, prompts: list, params: SamplingParams, dataset: str = "",
                    use_tqdm: bool = True) -> STSCalibration:
    """Decode speculatively and fit one temperature per position on the records. Every request
    drafts with every draft verified, whatever the engine's policy: rounds the policy chose by
    their confidences would be a sample selected on the very quantity being calibrated."""
    engine = llm.engine
    if engine.drafter is None or not engine.drafter.config.enable_confidence_head:
        raise ValueError("calibration needs a drafter with a confidence head")
    engine.confidence_records = []
    try:
        with engine.planning_with(None):
            llm.generate(prompts, params, use_tqdm=use_tqdm)
        records = engine.confidence_records
    finally:
        engine.confidence_records = None
    if not records:
        raise ValueError("no full verify rounds were recorded: use longer outputs or more prompts")
    logits = torch.tensor([z for z, _ in records])                 # [N, γ]
    accepted = torch.tensor([a for _, a in records])               # [N]
    labels = prefix_labels(accepted, logits.shape[1])
    cal = calibrate(logits, labels, sampling_temperature=params.temperature, dataset=dataset)
    logger.info("STS on %d rounds: ECE %s -> %s", len(records), cal.ece_before, cal.ece_after)
    return cal


def ece(pred: torch.Tensor, label: torch.Tensor, bins: int = 20) -> float:
    """Expected calibration error over equal-width probability bins."""
    return float(batched_ece(pred[None], label, bins)[0])


def batched_ece(pred: torch.Tensor, label: torch.Tensor, bins: int = 20) -> torch.Tensor:
    """pred [G, N] candidate predictions of the same labels [N] (or of labels [G, N], a row
    each) -> [G] ECE of each row."""
    g, n = pred.shape
    index = (pred.clamp(0, 1) * bins).long().clamp(max=bins - 1)
    index = index + torch.arange(g)[:, None] * bins                    # [G, N] into [G * bins]
    conf = torch.zeros(g * bins).index_add_(0, index.flatten(), pred.float().flatten())
    hits = torch.zeros(g * bins).index_add_(0, index.flatten(), label.float().expand(g, n).flatten())
    return (conf - hits).abs().view(g, bins).sum(-1) / max(n, 1)


def fit_sts(logits: torch.Tensor, labels: torch.Tensor,
            offsets: torch.Tensor = OFFSETS) -> tuple[list[float], list[float]]:
    """logits [N, γ] raw confidence logits; labels [N, γ] prefix-accept indicators (1 if accepted
    prefix >= k+1).  Returns (T_1..T_γ, b_1..b_γ) fitted left to right on the cumulative product;
    offsets=torch.zeros(1) fits temperatures alone (b = 0)."""
    logits, labels = logits.float(), labels.float()
    temps, biases = [], []
    prefix = torch.ones(logits.shape[0])
    for k in range(logits.shape[1]):
        t, b = _fit_position(logits[:, k], labels[:, k], prefix, GRID, offsets)
        temps.append(t)
        biases.append(b)
        prefix = prefix * torch.sigmoid(logits[:, k] / t + b)
    return temps, biases


def _fit_position(z: torch.Tensor, label: torch.Tensor, prefix: torch.Tensor, grid: torch.Tensor,
                  offsets: torch.Tensor) -> tuple[float, float]:
    """The (T, b) of the grids whose prefix * σ(z / T + b) has the least ECE: every temperature
    with every 5th offset, then every pair near the best one. Among equal errors, the pair
    nearest the identity (T = 1, b = 0) wins."""
    def best_of(ti: torch.Tensor, bi: torch.Tensor) -> tuple[int, int]:
        ti, bi = ti.repeat_interleave(len(bi)), bi.repeat(len(ti))      # every pair of the two
        t, b = grid[ti], offsets[bi]
        errors = torch.cat([batched_ece(prefix[None] * torch.sigmoid(z[None] / t[i:i + 256, None]
                                                                      + b[i:i + 256, None]), label)
                            for i in range(0, len(t), 256)])
        best = int(torch.argmin(errors.double() + 1e-9 * (t.log().abs() + b.abs()).double()))
        return int(ti[best]), int(bi[best])

    stride = 5 if len(offsets) > 5 else 1
    coarse = torch.arange(0, len(offsets), stride)
    zero = int(torch.argmin(offsets.abs()))                             # keep b = 0 a candidate
    coarse = torch.unique(torch.cat([coarse, torch.tensor([zero])]))
    ti, bi = best_of(torch.arange(len(grid)), coarse)
    near_t = torch.arange(max(ti - 4, 0), min(ti + 5, len(grid)))
    near_b = torch.arange(max(bi - stride, 0), min(bi + stride + 1, len(offsets)))
    ti, bi = best_of(near_t, near_b)
    return float(grid[ti]), float(offsets[bi])


def ece_floor(pred: torch.Tensor, bins: int = 20, draws: int = 200, seed: int = 0) -> float:
    """The mean ECE of `pred` [N] against labels drawn from `pred` itself: the error a perfectly
    calibrated predictor shows on N samples from sampling noise alone. An ECE near it is as small
    as N rounds can show; one well above it is miscalibration."""
    preds = pred.float().clamp(0, 1).expand(draws, -1)                                 # [draws, N]
    labels = torch.bernoulli(preds, generator=torch.Generator().manual_seed(seed))
    return float(batched_ece(preds, labels, bins).mean())


def _per_position_floor(survivals: torch.Tensor) -> list[float]:
    return [ece_floor(survivals[:, k], seed=k) for k in range(survivals.shape[1])]


def _per_position_ece(survivals: torch.Tensor, labels: torch.Tensor) -> list[float]:
    return [ece(survivals[:, k], labels[:, k]) for k in range(survivals.shape[1])]


def calibrate(logits: torch.Tensor, labels: torch.Tensor, sampling_temperature: float,
              dataset: str = "", seed: int = 0) -> STSCalibration:
    """Fit on every round (the shipped temperatures and offsets); also fit on a random 3/4 and
    score the remaining quarter, so the reported calibration is not only in-sample."""
    logits, labels = logits.float(), labels.float()
    ones = torch.ones(logits.shape[1])
    temps, offsets = fit_sts(logits, labels)
    perm = torch.randperm(logits.shape[0], generator=torch.Generator().manual_seed(seed))
    fit, test = perm[:logits.shape[0] * 3 // 4], perm[logits.shape[0] * 3 // 4:]
    split_temps, split_offsets = map(torch.tensor, fit_sts(logits[fit], labels[fit]))
    after = survival(logits, torch.tensor(temps), torch.tensor(offsets))                 # [N, γ]
    heldout_after = survival(logits[test], split_temps, split_offsets)
    return STSCalibration(
        temperatures=temps, offsets=offsets,
        ece_before=_per_position_ece(survival(logits, ones), labels),
        ece_after=_per_position_ece(after, labels),
        ece_heldout_before=_per_position_ece(survival(logits[test], ones), labels[test]),
        ece_heldout_after=_per_position_ece(heldout_after, labels[test]),
        ece_floor_after=_per_position_floor(after),
        ece_floor_heldout=_per_position_floor(heldout_after),
        num_samples=int(logits.shape[0]), sampling_temperature=sampling_temperature,
        dataset=dataset)


def prefix_labels(num_accepted: torch.Tensor, gamma: int) -> torch.Tensor:
    """a [N] -> y [N, γ] with y[n, k] = 1 iff the accepted prefix covers position k."""
    return (torch.arange(gamma)[None, :] < num_accepted[:, None]).float()
