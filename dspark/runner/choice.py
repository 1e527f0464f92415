"""`--graph auto`: CUDA graphs on NVIDIA; on a CPU, whichever of compile and eager is faster here.

Which wins on a CPU depends on the model, dtype, threads and torch build (docs/measurements.md),
so the all-dummy 1-token bucket is timed under both, alternately (a burst of foreign load then
reaches both alike); all-dummy skips attention, which is eager under both anyway. Compiling
every bucket costs start-up time, so compile must win by `min_gain`. The verdict is cached in a
JSON file keyed by a fingerprint of what it depends on.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from dspark.config import cache_root
from dspark.models.llama import CausalLM

logger = logging.getLogger(__name__)

MAX_CACHED_VERDICTS = 32        # oldest dropped first: model folders of finished runs pile up


@dataclass(frozen=True)
class GraphChoice:
    mode: str                   # "compile" or "eager"
    eager_ms: float             # median all-dummy 1-token step, eager
    compile_ms: float           # the same, compiled
    cached: bool = False        # read from the cache file rather than measured now


def default_cache_path() -> Path:
    """graph_choice.json in dspark's cache folder (config.cache_root)."""
    return cache_root() / "graph_choice.json"


def auto_mode(model: CausalLM, device: torch.device, aux_layer_ids: tuple[int, ...],
              fingerprint: dict, cache_path: Path) -> str:
    """The backend `auto` stands for on this device. `fingerprint` names the model and dtype;
    the torch build, device, thread count and weight layout are added here."""
    if device.type == "cuda":
        logger.info("graph auto: cuda (CUDA graphs on an NVIDIA GPU)")
        return "cuda"
    if device.type != "cpu":
        logger.info("graph auto: eager (no graph backend is measured on %s)", device.type)
        return "eager"
    down = model.layers[0].mlp.down_proj
    weights = "onednn+tiles" if down.tiles is not None else "onednn" if down.packed is not None else "dense"
    full = {**fingerprint, "torch": torch.__version__, "device": str(device),
            "num_threads": torch.get_num_threads(), "weights": weights}
    choice = choose_cpu_mode(full, cache_path,
                             lambda: time_one_token_buckets(model, device, aux_layer_ids))
    how = (f"measured earlier, cached in {cache_path}" if choice.cached
           else f"measured now, saved to {cache_path}")
    logger.info("graph auto: %s (1-token step %.3f ms compiled vs %.3f ms eager; %s)",
                choice.mode, choice.compile_ms, choice.eager_ms, how)
    return choice.mode


def choose_cpu_mode(fingerprint: dict, cache_path: Path, measure: Callable[[], tuple[float, float]],
                    min_gain: float = 0.05) -> GraphChoice:
    """The cached verdict for `fingerprint`, else measure() -> (eager ms, compile ms), keeping
    compile only if it is at least `min_gain` faster; the new verdict is cached."""
    key = json.dumps(fingerprint, sort_keys=True)
    verdicts = _read_verdicts(cache_path)
    if key in verdicts:
        try:
            cached = GraphChoice(**{**verdicts[key], "cached": True})
            if cached.mode in ("compile", "eager"):
                return cached
        except TypeError:
            pass
        logger.warning("ignoring a malformed graph verdict in %s", cache_path)
    eager_ms, compile_ms = measure()
    mode = "compile" if compile_ms < eager_ms * (1.0 - min_gain) else "eager"
    choice = GraphChoice(mode, eager_ms, compile_ms)
    verdicts.pop(key, None)
    verdicts[key] = {k: v for k, v in asdict(choice).items() if k != "cached"}
    _write_verdicts(cache_path, dict(list(verdicts.items())[-MAX_CACHED_VERDICTS:]))
    return choice


def interleaved_medians_ms(runs: dict[str, Callable[[], object]], replays: int = 7, warmup: int = 2,
                           timer: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median wall time in ms of each run, the runs taking turns call by call, after `warmup`
    untimed rounds, so that drift in the machine's load reaches every run alike."""
    for _ in range(warmup):
        for run in runs.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(replays):
        for name, run in runs.items():
            start = timer()
            run()
            times[name].append(timer() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def one_token_step(model: CausalLM, mode: str, device: torch.device,
                   aux_layer_ids: tuple[int, ...]) -> Callable[[], object]:
    """An all-dummy step at a 1-token bucket built (and compiled) for `mode` alone."""
    from dspark.runner.graphs import StepGraphs, dummy_metadata
    from dspark.models.kv_cache import allocate_kv_cache
    graphs = StepGraphs(model, mode, [1], device, aux_layer_ids)
    caches = allocate_kv_cache(model.config, 1, 1, model.embed_tokens.weight.dtype, device)
    graphs.capture(caches, 1)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    meta = dummy_metadata(1, device)
    return lambda: graphs.run(empty, empty, meta, caches)


def time_one_token_buckets(model: CausalLM, device: torch.device, aux_layer_ids: tuple[int, ...],
                           replays: int = 15) -> tuple[float, float]:
    """(eager ms, compiled ms) of the all-dummy 1-token step, measured alternately."""
    runs = {mode: one_token_step(model, mode, device, aux_layer_ids) for mode in ("eager", "compile")}
    ms = interleaved_medians_ms(runs, replays)
    return ms["eager"], ms["compile"]


def _read_verdicts(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        verdicts = json.loads(path.read_text()).get("verdicts", {})
        return verdicts if isinstance(verdicts, dict) else {}
    except (OSError, ValueError, AttributeError) as exc:
        logger.warning("ignoring unreadable graph verdicts in %s: %s", path, exc)
        return {}


def _write_verdicts(path: Path, verdicts: dict) -> None:
    """Written whole through a temporary file, so a concurrent start reads old or new, not half."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"verdicts": verdicts}, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not cache the graph verdict in %s (measured again next start): %s",
                       path, exc)
