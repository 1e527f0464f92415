"""The two engines a plain-against-DSpark comparison runs: the engine every engine flag on the
command line describes (drafter, schedule, cost table, threads, graphs ...), and the same engine
without its drafter. Building them from the flags, rather than from a few picked ones, is what
keeps a flag such as `--spec-schedule verify-all` from being silently ignored."""

from __future__ import annotations

import dataclasses

from dspark.config import SpecConfig
from dspark.config_flags import engine_config_from_args


def plain_and_spec(args):
    """-> (plain LLM, DSpark LLM or None when the flags name no drafter)."""
    from dspark import LLM
    config = engine_config_from_args(args)
    plain = LLM.from_config(dataclasses.replace(config, spec=SpecConfig(drafter=None)))
    spec = LLM.from_config(config) if config.spec.drafter is not None else None
    return plain, spec
