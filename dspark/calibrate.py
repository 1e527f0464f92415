"""`dspark calibrate`: record the confidence head on held-out prompts and fit STS."""

from __future__ import annotations

import logging

import torch

from dspark.llm import LLM
from dspark.sampling_params import SamplingParams
from dspark.spec.sts import STSCalibration, calibrate, prefix_labels

logger = logging.getLogger(__name__)


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
        with engine.verifying_all():
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
