"""The one seam between a worker's step and how its forwards run.

A step needs three forwards: the target's decoder stack over the step's rows, the drafter's
block pass (and Markov head) over the drafting requests, and the drafter's context append. How
each runs (eager, torch.compile, CUDA graphs, the fused CPU layer kernel for small bf16 steps,
at which padded bucket) is decided once, when the runner is built (setup.py), and the worker
asks only this object. The models stay plain modules: nothing is installed on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.models.drafter import Drafter
from dspark.models.layers import varlen_attention
from dspark.models.layers.attention import AttentionMetadata
from dspark.models.llama import CausalLM
from dspark.runner.draft_graphs import DraftGraphs, build_draft_graphs
from dspark.runner.fused_cpu import FusedDraftStack, FusedStack
from dspark.runner.graphs import StepGraphs, dummy_metadata
from dspark.spec.draft import KVCaches, append_context
from dspark.spec.sampler import SamplingTensors
from dspark.spec.types import DraftProposal
from dspark.runner.step_key import StepKey


@dataclass
class RunnerStats:
    """What the runner did, in one place: /metrics and the bench JSON read `counters()`. The
    attention counts are the process's (the kernel is called from the model's layers)."""
    target_replays: dict[int, int]      # token bucket -> target steps run at it
    target_eager_steps: int             # target steps above the largest bucket (unpadded)
    target_fused_steps: int             # target steps the fused CPU layer kernel ran
    capture_fallbacks: int              # buckets (target and draft) run eagerly after a failed capture
    draft_replays: dict[int, int]       # request bucket -> draft steps run at it
    draft_eager_steps: int              # draft steps above the largest request bucket
    dummy_steps: int                    # idle data-parallel steps run on dummies alone
    varlen_attention_calls: int         # CUDA attention calls through the variable-length kernel
    attention_fallbacks: int            # ... that ran SDPA instead (warned once per reason)

    def counters(self) -> dict[str, int]:
        """Flat totals, the names /metrics and the bench JSON use."""
        return {"target_graph_steps": sum(self.target_replays.values()),
                "target_eager_steps": self.target_eager_steps,
                "target_fused_steps": self.target_fused_steps,
                "capture_fallbacks": self.capture_fallbacks,
                "draft_graph_steps": sum(self.draft_replays.values()),
                "draft_eager_steps": self.draft_eager_steps,
                "dummy_steps": self.dummy_steps,
                "varlen_attention_calls": self.varlen_attention_calls,
                "attention_fallbacks": self.attention_fallbacks}


class Runner:
    """The forwards of one worker, at the backend chosen at start-up."""

    def __init__(self, model: CausalLM, graphs: StepGraphs, drafter: Drafter | None,
                 fused_draft: FusedDraftStack | None, max_num_seqs: int):
        self.model, self.graphs, self.drafter = model, graphs, drafter
        self.fused_draft = fused_draft
        self.max_num_seqs = max_num_seqs
        self.draft_graphs: DraftGraphs | None = None      # built with the caches (`capture`)
        self.block_size: int | None = None                # the caches' (`capture`)
        self.dummy_steps = 0
        self.threads = torch.get_num_threads()           # what compiled graphs are specialised to

    def check_threads(self) -> None:
        """Compiled graphs are specialised to torch's CPU thread count at capture: after a later
        `torch.set_num_threads` the next step would recompile past its limit and fail every
        request in it. Refused before a step is scheduled instead, naming the fix."""
        now = torch.get_num_threads()
        if now != self.threads and self.graphs.mode == "compile":
            raise RuntimeError(
                f"torch's CPU thread count changed from {self.threads} to {now} after the engine "
                f"started, and its compiled graphs are specialised to {self.threads} threads: call "
                f"torch.set_num_threads({self.threads}) again, or start the engine with "
                f"num_threads={now}")

    @property
    def fused(self) -> FusedStack | None:
        return self.graphs.fused

    def capture(self, kv_caches: KVCaches, draft_kv: KVCaches | None, num_blocks: int,
                block_size: int) -> None:
        """Capture (or compile) every bucket of the target and of the draft step, over the
        caches they will run on, before anything is served."""
        self.block_size = block_size
        self.graphs.capture(kv_caches, block_size)
        if self.drafter is not None:
            self.draft_graphs = build_draft_graphs(
                self.drafter, self.graphs, num_blocks, block_size,
                self.model.config.max_position_embeddings, self.max_num_seqs, self.fused_draft)
            self.draft_graphs.capture(draft_kv)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KVCaches, key: StepKey | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's stack over a step's rows [T] -> (hidden [T, d], aux hidden [T, m*d] or
        None), at its bucket (the agreed one under data parallelism)."""
        args = (input_ids, positions, meta, kv_caches)
        if key is None:
            return self.graphs.run(*args)
        if key.tokens is None:
            return self.graphs.run_unpadded(*args)
        return self.graphs.run(*args, bucket=key.tokens, use_runner=key.captured)

    def draft(self, draft_kv: KVCaches, anchors: torch.Tensor, starts: torch.Tensor,
              block_tables: torch.Tensor, st: SamplingTensors, key: StepKey | None = None) -> DraftProposal:
        """anchors/starts [R], block_tables [R, W] -> γ drafts per request, at their request
        bucket; a data-parallel `key` forces the padded shape."""
        bucket = width = None
        if key is not None and key.draft_reqs in self.draft_graphs.buffers:   # else above every bucket
            bucket, width = key.draft_reqs, key.table_width
        return self.draft_graphs.run(draft_kv, anchors, starts, block_tables, st,
                                     bucket=bucket, table_width=width).proposal

    def append_context(self, draft_kv: KVCaches, aux_hidden: torch.Tensor, positions: torch.Tensor,
                       write_rows: torch.Tensor | None, write_slots: torch.Tensor) -> None:
        """The target rows just run into the drafter's context K/V."""
        append_context(self.drafter, draft_kv, aux_hidden, positions, write_rows, write_slots,
                       self.fused_draft)

    def dummy_step(self, key: StepKey, kv_caches: KVCaches, draft_kv: KVCaches | None) -> None:
        """An idle data-parallel rank's share of a step: the agreed key run on dummies alone
        (no live row, no K/V write, outputs dropped), so its peers' graphs have a partner."""
        if key.idle:
            return
        bucket = key.tokens if key.tokens is not None else self.graphs.buckets[-1]
        empty = torch.zeros(0, dtype=torch.long, device=self.graphs.device)
        if self.draft_graphs is not None and key.draft_reqs in self.draft_graphs.buffers:
            self.draft_graphs.run(draft_kv, empty, empty, empty.view(0, 1), bucket=key.draft_reqs,
                                  table_width=key.table_width)
        self.graphs.run(empty, empty, dummy_metadata(self.block_size, self.graphs.device), kv_caches,
                        bucket=bucket, use_runner=key.captured)
        self.dummy_steps += 1

    def stats(self) -> RunnerStats:
        target, draft = self.graphs.stats, self.draft_graphs.stats if self.draft_graphs else None
        return RunnerStats(
            target_replays=dict(target.replays), target_eager_steps=target.eager_steps,
            target_fused_steps=target.fused_steps,
            capture_fallbacks=target.capture_fallbacks + (draft.capture_fallbacks if draft else 0),
            draft_replays=dict(draft.replays) if draft else {},
            draft_eager_steps=draft.eager_steps if draft else 0,
            dummy_steps=self.dummy_steps, varlen_attention_calls=varlen_attention.STATS.calls,
            attention_fallbacks=sum(varlen_attention.STATS.fallbacks.values()))
