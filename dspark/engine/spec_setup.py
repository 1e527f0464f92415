"""What a speculative engine settles before it serves: the fingerprint a cost table must match,
the STS calibration, and the speculation policy with its cost table checked or measured. All of it
is start-up work, so a misconfiguration is an error before the first request, not during one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from dspark.config import EngineConfig, cache_root
from dspark.models.drafter import Drafter
from dspark.spec.planner import CostTable
from dspark.spec.policy import SpecPolicy
from dspark.spec.sts import STSCalibration
from dspark.runner.graphs import StepGraphs
from dspark.worker.profile import PROFILE_VERSION, ProfileConfig

logger = logging.getLogger(__name__)


def cost_fingerprint(config: EngineConfig, drafter: Drafter | None, graphs: StepGraphs,
                     device: torch.device) -> dict:
    """What a cost table must have been measured on to price this engine's steps."""
    return {"device": device.type, "model": config.model or "embedded",
            "dtype": config.dtype, "drafter": config.spec.drafter,
            "drafter_config": _config_digest(config.spec.drafter),
            "gamma": drafter.config.block_size if drafter is not None else 0,
            "num_threads": torch.get_num_threads() if device.type == "cpu" else None,
            "graph": graphs.mode, "buckets": graphs.buckets, "profile": PROFILE_VERSION}


def load_sts(config: EngineConfig, drafter: Drafter | None, gamma: int) -> STSCalibration | None:
    if config.spec.sts is None:
        return None
    if not drafter.config.enable_confidence_head:
        raise ValueError("an STS calibration was given but the drafter has no confidence head")
    sts = STSCalibration.load(config.spec.sts)
    sts.validate(gamma)
    return sts


def spec_policy(config: EngineConfig, drafter: Drafter | None, gamma: int,
                sts: STSCalibration | None, max_model_len: int, fingerprint: dict,
                profile: Callable[[ProfileConfig], CostTable]) -> SpecPolicy | None:
    """The speculation policy with its cost table: a given file (checked against
    `fingerprint`), measured now by `profile` (`auto`), or by default measured once per setup and
    cached; None without a drafter or with verify-all."""
    spec = config.spec
    if drafter is None or spec.spec_schedule != "confidence":
        return None
    if not drafter.config.enable_confidence_head:
        logger.warning("the drafter has no confidence head to schedule by: every draft is verified")
        return None
    shape = _profile_config(config, gamma, max_model_len)
    if spec.cost_table == "auto":
        table = profile(shape)
    elif spec.cost_table is None:
        key = {**fingerprint, "profile": dataclasses.asdict(shape), "torch": torch.__version__,
               "machine": _machine()}
        table = cached_cost_table(fingerprint, key, lambda: profile(shape), cache_root() / "cost_tables")
    else:
        table = CostTable.load(spec.cost_table)
        table.check_fingerprint(fingerprint)
    return SpecPolicy(table, sts, gamma, spec.confidence_lag, spec.min_gain, max_kept=spec.max_kept_plans)


def _profile_config(config: EngineConfig, gamma: int, max_model_len: int) -> ProfileConfig:
    sched = config.scheduler
    max_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * (gamma + 1))
    return ProfileConfig(max_tokens=max_tokens, max_requests=sched.max_num_seqs,
                         context_len=min(256, max_model_len - gamma - 1),
                         token_stride=max(1, max_tokens // 32), repeats=3, warmup=1)


def cached_cost_table(fingerprint: dict, key: dict, measure: Callable[[], CostTable],
                      folder: Path) -> CostTable:
    """The cost table of this setup from `folder` (a file per `key`: the fingerprint, what was
    measured, the machine), measured and stored the first time. A file that cannot be read or
    was made for another setup is measured again (warned), never trusted."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = folder / f"cost-{digest}.json"
    if path.exists():
        try:
            table = CostTable.load(str(path))
            table.check_fingerprint(fingerprint)
            logger.info("cost model: %s (measured earlier for this setup)", path)
            return table
        except (OSError, ValueError) as exc:
            logger.warning("the cached cost model %s is not usable (%s); measuring it again", path, exc)
    logger.info("measuring the cost model of this setup (once; cached in %s)", path)
    table = measure()
    folder.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    table.save(str(scratch))
    os.replace(scratch, path)                    # readers never see half a file
    return table


def _machine() -> str:
    """The CPU model (a cached table measured on another machine must not be reused)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def _config_digest(folder: str | None) -> str | None:
    """A short hash of the drafter's config.json: a drafter replaced in the same folder (another
    vocabulary, depth or γ) must not be priced with the old drafter's costs."""
    path = None if folder is None else Path(folder, "config.json")
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path is not None and path.is_file() else None
