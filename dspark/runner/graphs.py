"""Graph buckets: the target's decoder stack run at a few padded, static token counts.

A step of T live tokens runs at the smallest bucket B >= T (the graph key); rows T..B-1 are
dummies (token 0 at position 0, past `AttentionMetadata.num_tokens`: no K/V write, no attention,
outputs dropped), refreshed in place at every replay so that a shrinking batch leaves no stale
row. The backends (`eager`, `compile`, `cuda`: runner/backends.py) share this path; steps above
the largest bucket run unpadded and are counted. docs/graphs.md has the whole design.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from dspark.models.layers.attention import AttentionMetadata
from dspark.models.llama import CausalLM
from dspark.runner.fused_cpu import FusedStack

logger = logging.getLogger(__name__)

DUMMY_TOKEN_ID = 0
DUMMY_POSITION = 0


def token_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64, of 16 up to 128 and of 32 up to 256, then powers of
    two, up to max_tokens (included); why this spacing: docs/graphs.md, "Buckets"."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_tokens}
    low = 8
    for step, top in ((8, 64), (16, 128), (32, 256)):
        sizes |= set(range(low + step, min(top, max_tokens) + 1, step))
        low = top
    b = 512
    while b < max_tokens:
        sizes.add(b)
        b *= 2
    sizes.add(max_tokens)
    return sorted(sizes)


@dataclass
class GraphStats:
    """What a StepGraphs or DraftGraphs ran (RunnerStats gathers them)."""
    replays: dict[int, int] = field(default_factory=dict)    # bucket -> steps run at it
    eager_steps: int = 0            # steps above the largest bucket or the buffers (run unpadded)
    capture_fallbacks: int = 0      # buckets run eagerly because their capture failed
    fused_steps: int = 0            # target steps the fused CPU layer kernel ran (runner/fused_cpu.py)


def check_graph_setup(mode: str, device: torch.device, buckets: list[int], unit: str) -> None:
    """A known mode, CUDA graphs only on an NVIDIA GPU, increasing positive buckets."""
    if mode not in ("cuda", "compile", "eager"):
        raise ValueError(f"graph mode must be one of cuda, compile, eager; got {mode!r}")
    if mode == "cuda" and not (device.type == "cuda" and torch.cuda.is_available()):
        raise ValueError("--graph cuda needs an NVIDIA GPU; use compile or eager on this device")
    if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
        raise ValueError(f"buckets must be increasing positive {unit} counts, got {buckets}")


class StepGraphs:
    """The decoder stack of one target, one runnable per token bucket."""

    def __init__(self, model: CausalLM, mode: str, buckets: list[int], device: torch.device,
                 aux_layer_ids: tuple[int, ...] = (), fallback_to_eager: bool = False,
                 fused: FusedStack | None = None):
        check_graph_setup(mode, device, buckets, "token")
        self.model, self.mode, self.buckets, self.device = model, mode, list(buckets), device
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.fallback_to_eager = fallback_to_eager
        self.fused = fused                     # takes the small steps first, whatever the mode
        self.stats = GraphStats()
        self.input_ids = {b: torch.full((b,), DUMMY_TOKEN_ID, dtype=torch.long, device=device)
                          for b in buckets}                                   # [B] per bucket
        self.positions = {b: torch.full((b,), DUMMY_POSITION, dtype=torch.long, device=device)
                          for b in buckets}
        self.runners: dict[int, object] = {}
        self.compiled = None                   # the torch.compile wrapper (compile mode)
        self.graph_pool = None                 # the memory pool all buckets' CUDA graphs share

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest bucket holding `num_tokens` rows (None: larger than every bucket)."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    # ---- capture ------------------------------------------------------------------------------
    def capture(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> None:
        """Build every bucket's runnable, largest first, by running it on all-dummy input."""
        from dspark.runner.backends import build_runner
        self.stats.capture_fallbacks += capture_largest_first(
            self.buckets, lambda b: build_runner(self, b, kv_caches, dummy_metadata(block_size, self.device)),
            self.runners, self.fallback_to_eager, f"graph capture ({self.mode})", "token",
            show=self.mode != "eager")

    # ---- replay -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], bucket: int | None = None,
            use_runner: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids/positions [T] live rows -> (hidden [T, d], aux hidden [T, m*d] or None).

        `bucket` forces the bucket (a data-parallel group's agreed key; it must hold T);
        `use_runner=False` runs it on the padded eager path (a peer has no capture of it)."""
        t = input_ids.shape[0]
        b = self.bucket_for(t) if bucket is None else bucket
        if bucket is not None and (bucket not in self.input_ids or bucket < t):
            raise ValueError(f"a {t}-token step cannot run at bucket {bucket} (buckets: {self.buckets})")
        if b is None:
            return self.run_unpadded(input_ids, positions, meta, kv_caches)
        self.stats.replays[b] = self.stats.replays.get(b, 0) + 1
        ids, pos = self.input_ids[b], self.positions[b]
        ids[:t].copy_(input_ids)
        ids[t:].fill_(DUMMY_TOKEN_ID)          # rows a larger batch left here become padding again
        pos[:t].copy_(positions)
        pos[t:].fill_(DUMMY_POSITION)
        meta = dataclasses.replace(meta, num_tokens=t)
        runner = self.runners.get(b) if use_runner else None
        if self._fused_takes(b, meta):
            x, aux = self.fused.run(self.model, ids, pos, meta, kv_caches, self.aux_layer_ids)
        elif runner is None:                   # not captured (eager mode or a capture fallback)
            x, aux = self.model.run_stack(ids, pos, meta, kv_caches, self.aux_layer_ids)
        else:
            x, aux = runner(ids, pos, meta, kv_caches)
        return x[:t], None if aux is None else aux[:t]

    def run_unpadded(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step above the largest bucket (or any step, without buckets): at its own shape, counted."""
        if self._fused_takes(input_ids.shape[0], meta):
            return self.fused.run(self.model, input_ids, positions, meta, kv_caches, self.aux_layer_ids)
        self.stats.eager_steps += 1
        return self.model.run_stack(input_ids, positions, meta, kv_caches, self.aux_layer_ids)

    def _fused_takes(self, rows: int, meta: AttentionMetadata) -> bool:
        if self.fused is None or not self.fused.takes(rows, meta):
            return False
        self.stats.fused_steps += 1
        return True


def capture_largest_first(buckets: list[int], build, runners: dict, fallback_to_eager: bool,
                          what: str, unit: str, show: bool = True) -> int:
    """runners[b] = build(b) for every bucket, largest first (smaller ones reuse its memory). A
    failure is a start-up error naming the bucket, or with `fallback_to_eager` a None runner
    (eager), warned; -> the number of such fallbacks. `show`: a progress bar (compiling is slow)."""
    fallbacks = 0
    for b in tqdm(sorted(buckets, reverse=True), desc=f"{what}: {unit} buckets", disable=not show):
        try:
            runners[b] = build(b)
        except Exception as exc:             # noqa: BLE001 (any backend failure is reported)
            if not fallback_to_eager:
                raise RuntimeError(f"{what} failed for the {b}-{unit} bucket: {exc}") from exc
            logger.warning("%s failed for the %d-%s bucket, running it eagerly (counted in "
                           "capture_fallbacks): %s", what, b, unit, exc)
            fallbacks += 1
            runners[b] = None
    return fallbacks


def dummy_metadata(block_size: int, device: torch.device) -> AttentionMetadata:
    """A step with no live row: what a capture warm-up (and an idle data-parallel rank) runs."""
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return AttentionMetadata(num_reqs=0, max_q=0, write_rows=None, write_slots=empty,
                             block_tables=torch.zeros(0, 1, dtype=torch.long, device=device),
                             block_size=block_size, kv_len=0, q_index=None, mask=None, num_tokens=0)
