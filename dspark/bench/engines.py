"""Which engines a benchmark builds from the engine flags.

`spec`, `demo` and `serve` build their engines from every engine flag (drafter, schedule, cost
table, threads, graphs ...): the DSpark engine as described, plain decoding as the same engine
without its drafter. The other modes build the engines they compare themselves and pass on a
few flags; any other engine flag set on their command line is refused, never silently ignored.
"""

from __future__ import annotations

import dataclasses

from dspark.config import SpecConfig
from dspark.config_flags import engine_config_from_args, engine_flags

_POLICY = {"model", "drafter", "dtype", "device", "num_threads", "graph", "cost_table", "min_gain",
           "max_kept_plans"}
HONOURED = {        # mode -> the engine fields it passes to the engines it builds
    "plain": {"model", "dtype", "num_threads"},
    "sweep": _POLICY,
    "policy": _POLICY,
    "graphs": {"model", "drafter", "dtype", "device", "num_threads", "max_graph_tokens"},
    "dp": {"model", "drafter", "no_drafter", "dtype", "num_threads", "graph", "data_parallel_size"},
    "kernels": {"num_threads"},
}


def refuse_ignored_engine_flags(args) -> None:
    """SystemExit naming every engine flag set away from its default that `args.mode` does not
    pass on to its engines (a --no-NAME switch counts apart from its field)."""
    honoured = HONOURED.get(args.mode)
    if honoured is None:                     # spec and serve: every engine flag
        return
    ignored, taken = [], []
    for flag in engine_flags():
        if flag.field.name in honoured:
            taken.append(flag.name)
        elif getattr(args, flag.dest) != flag.field.default:
            ignored.append(flag.name)
        if flag.none_dest is not None and getattr(args, flag.none_dest) \
                and "no_" + flag.field.name not in honoured:
            ignored.append("--no-" + flag.name.removeprefix("--"))
    if ignored:
        raise SystemExit(f"bench --mode {args.mode} does not pass {', '.join(ignored)} to its "
                         f"engines; of the engine flags it takes {', '.join(taken)}")


def plain_and_spec(args):
    """-> (plain LLM, DSpark LLM or None when the flags name no drafter)."""
    from dspark import LLM
    config = engine_config_from_args(args)
    plain = LLM.from_config(dataclasses.replace(config, spec=SpecConfig(drafter=None)))
    spec = LLM.from_config(config) if config.spec.drafter is not None else None
    return plain, spec
