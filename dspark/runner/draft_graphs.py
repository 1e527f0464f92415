"""Graph buckets for the draft step: the drafter's block pass at a few padded request counts.

A draft step of R live requests runs at the smallest request bucket Rb >= R, through per-bucket
buffers refreshed in place at every replay. Rows R..Rb-1 are dummy requests (docs/graphs.md):
anchor DUMMY_TOKEN_ID at start 0 (no context), a block-table row of DUMMY_BLOCK_ID (read and
masked out, never written: the draft step writes no K/V), greedy, a neutral confidence row and
an id in the reserved DUMMY_REQUEST_PREFIX namespace; their outputs are sliced off before
allocation or acceptance sees them. The context length L stays a dynamic dimension of the
compiled graph, so the page-table width needs no bucket of its own. The backend follows the
target's `StepGraphs.mode` (`cuda`: runner/draft_pieces.py); steps with more requests than the
largest bucket, or tables wider than the buffers, run unpadded and are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._dynamo

from dspark.models.drafter import Drafter
from dspark.spec.draft import BlockPass, FusedDraft, KVCaches, block_pass, propose
from dspark.spec.sampler import SamplingTensors
from dspark.spec.types import DraftProposal
from dspark.runner.backends import lower_packed_linear
from dspark.runner.draft_pieces import DraftPieces, capture_draft_bucket
from dspark.runner.graphs import (DUMMY_TOKEN_ID, GraphStats, StepGraphs, capture_largest_first,
                                  check_graph_setup, token_buckets)

DUMMY_REQUEST_PREFIX = "__dspark_dummy__:"   # reserved: no live request id may start with it
DUMMY_START = 0                  # a dummy anchor sits at position 0: no context before it
DUMMY_BLOCK_ID = 0               # read (masked out) by dummy rows, never written by a draft step
NEUTRAL_CONFIDENCE_LOGIT = 30.0  # sigmoid ~ 1: "unknown, verify all", never an early stop
MIN_CONTEXT = 2                  # a dynamic dimension of size 0 or 1 would be specialised


def dummy_request_id(row: int) -> str:
    return f"{DUMMY_REQUEST_PREFIX}{row}"


def is_reserved_request_id(request_id: str) -> bool:
    return request_id.startswith(DUMMY_REQUEST_PREFIX)


@dataclass
class DraftBuffers:
    """One request bucket's inputs, refreshed in place at every replay (never reallocated)."""
    anchors: torch.Tensor        # [Rb] x0 (DUMMY_TOKEN_ID on dummy rows)
    starts: torch.Tensor         # [Rb] anchor positions (DUMMY_START on dummy rows)
    block_tables: torch.Tensor   # [Rb, W_max] int32 (DUMMY_BLOCK_ID on dummy rows, past a table)
    temperature: torch.Tensor    # [Rb] (1.0 on dummy rows)
    greedy: torch.Tensor         # [Rb] bool (True on dummy rows)


@dataclass
class PaddedDraft:
    """A draft step as it ran: the live rows for the caller, all rows for inspection."""
    proposal: DraftProposal      # the R live rows: all that allocation and acceptance ever see
    padded: DraftProposal        # the Rb rows (dummies' confidence logits set neutral)
    bucket: int | None           # the request bucket (None: ran unpadded)
    row_ids: list[str | None]    # [Rb] live request ids (None where the caller gave none), dummy ids


class DraftGraphs:
    """The drafter's block pass of one worker, one runnable per request bucket."""

    def __init__(self, drafter: Drafter, mode: str, buckets: list[int], device: torch.device,
                 block_size: int, max_pages: int, fallback_to_eager: bool = False,
                 fused: FusedDraft | None = None):
        check_graph_setup(mode, device, buckets, "request")
        self.drafter, self.mode, self.buckets, self.device = drafter, mode, list(buckets), device
        self.block_size, self.fallback_to_eager = block_size, fallback_to_eager
        self.fused = fused                   # takes the small block passes first, whatever the mode
        self.min_pages = -(-MIN_CONTEXT // block_size)
        self.max_pages = max(max_pages, self.min_pages)
        self.stats = GraphStats()
        # one table pool shared by every bucket (replays never overlap), each a view of its rows
        tables = torch.full((buckets[-1], self.max_pages), DUMMY_BLOCK_ID, dtype=torch.int32, device=device)
        self.buffers = {b: _buffers(b, tables[:b], device) for b in buckets}
        self.runners: dict[int, BlockPass | None] = {}
        self.compiled = None                 # the torch.compile wrapper of `block_pass` (compile mode)
        self.graph_pool = None               # the memory pool all draft buckets' CUDA graphs share

    def bucket_for(self, num_requests: int) -> int | None:
        """The smallest bucket holding `num_requests` rows (None: larger than every bucket)."""
        return next((b for b in self.buckets if b >= num_requests), None)

    # ---- capture ------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, kv: KVCaches) -> None:
        """Build every bucket's runnable, largest first, by replaying it on dummies alone."""
        self.stats.capture_fallbacks += capture_largest_first(
            self.buckets, lambda b: self._build(b, kv), self.runners, self.fallback_to_eager,
            f"draft graph capture ({self.mode})", "request", show=self.mode != "eager")

    def _build(self, bucket: int, kv: KVCaches) -> BlockPass | None:
        if self.mode == "cuda":
            return self._capture_cuda(bucket, kv)
        if self.mode != "compile":
            return None
        if self.compiled is None:
            lower_packed_linear()
            # one entry per bucket, a recompile at replay an error, isolated (as backends._compiled)
            options = {"freezing": True} if self.device.type == "cpu" else {}
            self.compiled = torch.compile(block_pass, dynamic=False, fullgraph=True, options=options,
                                          recompile_limit=len(self.buckets), isolate_recompiles=True)
        runner = _dynamic_context(self.compiled, max(self.max_pages * self.block_size, MIN_CONTEXT + 1))
        self._dummy_replay(bucket, kv, runner)                                   # compiles
        return runner

    def _capture_cuda(self, bucket: int, kv: KVCaches) -> DraftPieces:
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        return capture_draft_bucket(self.drafter, bucket, lambda: self._dummy_replay(bucket, kv, None),
                                    self.graph_pool)

    def _dummy_replay(self, bucket: int, kv: KVCaches, runner: BlockPass | None) -> PaddedDraft:
        """The bucket on dummies alone (what a capture runs first)."""
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        return self._replay(bucket, kv, empty, empty, empty.view(0, 1), _all_greedy(0, self.device), None,
                            self.min_pages, runner)

    # ---- replay -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, kv: KVCaches, anchors: torch.Tensor, starts: torch.Tensor, block_tables: torch.Tensor,
            st: SamplingTensors | None = None, request_ids: list[str] | None = None,
            bucket: int | None = None, table_width: int | None = None) -> PaddedDraft:
        """anchors/starts [R], block_tables [R, W] of the live requests -> their drafts.

        `st` None: every row greedy. `bucket` and `table_width` force the padded shape (a
        data-parallel group's agreed key; they must hold R and W); R may be 0 (an all-dummy step).
        `request_ids` [R] name the live rows in `PaddedDraft.row_ids` (none may be reserved).
        """
        r, w = anchors.shape[0], block_tables.shape[1]
        st = st if st is not None else _all_greedy(r, self.device)
        if request_ids is not None:
            _check_live_ids(request_ids, r)
        b = self.bucket_for(r) if bucket is None else bucket
        # a forced width pads up to the buffers' capacity at most: the context length is a dynamic
        # dimension of the graph, so the width is not part of the graph key here
        width = max(w, min(table_width or 0, self.max_pages), self.min_pages)
        if bucket is not None and (bucket not in self.buffers or bucket < r):
            raise ValueError(f"a {r}-request draft step cannot run at bucket {bucket} "
                             f"(buckets: {self.buckets})")
        if table_width is not None and table_width < w:
            raise ValueError(f"block tables of {w} pages cannot run at a table width of {table_width}")
        if b is None or width > self.max_pages:
            self.stats.eager_steps += 1
            p = propose(self.drafter, kv, anchors, starts, block_tables, self.block_size, st, fused=self.fused)
            return PaddedDraft(p, p, None, list(request_ids) if request_ids is not None else [None] * r)
        self.stats.replays[b] = self.stats.replays.get(b, 0) + 1
        return self._replay(b, kv, anchors, starts, block_tables, st, request_ids, width,
                            self.runners.get(b))

    def _replay(self, b: int, kv: KVCaches, anchors: torch.Tensor, starts: torch.Tensor,
                block_tables: torch.Tensor, st: SamplingTensors, request_ids: list[str] | None,
                width: int, runner: BlockPass | None) -> PaddedDraft:
        r, w = anchors.shape[0], block_tables.shape[1]
        buf = self.buffers[b]
        buf.anchors[:r].copy_(anchors)
        buf.anchors[r:].fill_(DUMMY_TOKEN_ID)
        buf.starts[:r].copy_(starts)
        buf.starts[r:].fill_(DUMMY_START)
        buf.block_tables[:r, :w].copy_(block_tables)
        buf.block_tables[:r, w:].fill_(DUMMY_BLOCK_ID)
        buf.block_tables[r:].fill_(DUMMY_BLOCK_ID)
        buf.temperature[:r].copy_(st.temperature)
        buf.temperature[r:].fill_(1.0)
        buf.greedy[:r].copy_(st.greedy)
        buf.greedy[r:].fill_(True)
        pad = b - r
        padded_st = SamplingTensors(
            temperature=buf.temperature, top_k=None, top_p=None, min_p=None, greedy=buf.greedy,
            all_greedy=st.all_greedy, keys=list(st.keys) + [None] * pad,
            greedy_host=list(st.greedy_host) + [True] * pad)
        padded = propose(self.drafter, kv, buf.anchors, buf.starts, buf.block_tables[:, :width],
                         self.block_size, padded_st, kv_len=width * self.block_size, run_block=runner,
                         fused=self.fused)
        if padded.confidence_logits is not None:
            padded.confidence_logits[r:] = NEUTRAL_CONFIDENCE_LOGIT               # [Rb-R, γ]
        live = DraftProposal(tokens=padded.tokens[:r],                              # [R, γ]
                             probs=None if padded.probs is None else padded.probs[:r],
                             confidence_logits=None if padded.confidence_logits is None
                             else padded.confidence_logits[:r])
        ids = list(request_ids) if request_ids is not None else [None] * r
        return PaddedDraft(live, padded, b, ids + [dummy_request_id(i) for i in range(pad)])


def build_draft_graphs(drafter: Drafter, graphs: StepGraphs, num_blocks: int, block_size: int,
                       max_positions: int, max_num_seqs: int, fused: FusedDraft | None) -> DraftGraphs:
    """The draft graphs of a worker whose target runs at `graphs`, in the same mode. Request
    buckets reach the largest token bucket (a drafted request puts its anchor into the target
    step), max_num_seqs and one request per KV block; page tables, `max_positions` plus a block."""
    cap = min(graphs.buckets[-1], num_blocks, max_num_seqs)
    slots = drafter.config.num_block_slots
    max_pages = min(num_blocks, -(-(max_positions + slots) // block_size))
    return DraftGraphs(drafter, graphs.mode, token_buckets(cap), graphs.device, block_size, max_pages,
                       graphs.fallback_to_eager, fused)


def _buffers(bucket: int, tables: torch.Tensor, device: torch.device) -> DraftBuffers:
    return DraftBuffers(
        anchors=torch.full((bucket,), DUMMY_TOKEN_ID, dtype=torch.long, device=device),
        starts=torch.full((bucket,), DUMMY_START, dtype=torch.long, device=device),
        block_tables=tables,
        temperature=torch.ones(bucket, dtype=torch.float32, device=device),
        greedy=torch.ones(bucket, dtype=torch.bool, device=device))


def _all_greedy(rows: int, device: torch.device) -> SamplingTensors:
    return SamplingTensors(temperature=torch.ones(rows, device=device), top_k=None, top_p=None,
                           min_p=None, greedy=torch.ones(rows, dtype=torch.bool, device=device),
                           all_greedy=True, keys=[None] * rows, greedy_host=[True] * rows)


def _check_live_ids(request_ids: list[str], rows: int) -> None:
    if len(request_ids) != rows:
        raise ValueError(f"{len(request_ids)} request ids for {rows} draft rows")
    reserved = [i for i in request_ids if is_reserved_request_id(i)]
    if reserved:
        raise ValueError(f"request ids {reserved} use the prefix {DUMMY_REQUEST_PREFIX!r} reserved "
                         "for dummy requests")


def _dynamic_context(compiled: BlockPass, max_len: int) -> BlockPass:
    """The compiled block pass with the context length L (dim 1 of ctx_k, ctx_v, ctx_valid)
    marked dynamic on every call: without it dynamo would specialise, and recompile, per L."""
    def run(drafter, block_ids, positions, ctx_k, ctx_v, ctx_valid, anchors):
        for t in (*ctx_k, *ctx_v, ctx_valid):
            torch._dynamo.mark_dynamic(t, 1, min=MIN_CONTEXT, max=max_len)
        return compiled(drafter, block_ids, positions, ctx_k, ctx_v, ctx_valid, anchors)
    return run
