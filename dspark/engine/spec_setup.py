"""What a speculative engine settles before it serves: the fingerprint a cost table must match,
the STS calibration, and the confidence scheduler with its table checked or measured. All of it
is start-up work, so a misconfiguration is an error before the first request, not during one."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import torch

from dspark.config import EngineConfig
from dspark.engine.spec_schedule import ConfidenceScheduler
from dspark.models.drafter import Drafter
from dspark.spec.planner import CostTable
from dspark.spec.sts import STSCalibration
from dspark.worker.graphs import StepGraphs
from dspark.worker.profile import ProfileConfig


def cost_fingerprint(config: EngineConfig, drafter: Drafter | None, graphs: StepGraphs,
                     device: torch.device) -> dict:
    """What a cost table must have been measured on to price this engine's steps."""
    return {"device": device.type, "model": config.model or "embedded",
            "dtype": config.dtype, "drafter": config.spec.drafter,
            "drafter_config": _file_digest(config.spec.drafter, "config.json"),
            "gamma": drafter.config.block_size if drafter is not None else 0,
            "num_threads": torch.get_num_threads() if device.type == "cpu" else None,
            "graph": graphs.mode, "buckets": graphs.buckets}


def load_sts(config: EngineConfig, drafter: Drafter | None, gamma: int) -> STSCalibration | None:
    if config.spec.sts is None:
        return None
    if not drafter.config.enable_confidence_head:
        raise ValueError("an STS calibration was given but the drafter has no confidence head")
    sts = STSCalibration.load(config.spec.sts)
    sts.validate(gamma)
    return sts


def confidence_scheduler(config: EngineConfig, drafter: Drafter | None, gamma: int,
                         sts: STSCalibration | None, max_model_len: int, fingerprint: dict,
                         profile: Callable[[ProfileConfig], CostTable]) -> ConfidenceScheduler | None:
    """The verify-budget planner, with its cost table checked against `fingerprint` (or measured
    by `profile` for `--cost-table auto`); None without confidence scheduling."""
    spec = config.spec
    if spec.spec_schedule != "confidence":
        return None
    if not drafter.config.enable_confidence_head:
        raise ValueError("confidence scheduling needs a drafter with a confidence head")
    if spec.cost_table == "auto":
        sched = config.scheduler
        max_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * (gamma + 1))
        table = profile(ProfileConfig(
            max_tokens=max_tokens, max_requests=sched.max_num_seqs,
            context_len=min(256, max_model_len - gamma - 1),
            token_stride=max(1, max_tokens // 32), repeats=3, warmup=1))
    else:
        table = CostTable.load(spec.cost_table)
        table.check_fingerprint(fingerprint)
    return ConfidenceScheduler(table, sts, gamma, spec.confidence_lag, spec.min_gain,
                               spec.probe_interval, cost_correction=spec.cost_correction)


def _file_digest(folder: str | None, name: str) -> str | None:
    """A short content hash: a drafter replaced in the same folder (another vocabulary, depth or
    γ) must not be priced with the old drafter's costs."""
    if folder is None or not os.path.isfile(os.path.join(folder, name)):
        return None
    with open(os.path.join(folder, name), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]
