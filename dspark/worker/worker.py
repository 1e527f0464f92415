"""Owns the target (and drafter), their KV caches and the sampler; one device->host copy a step.

A step's chunks are prefill chunks, plain decode tokens and speculative blocks, all in one ragged
target forward.  For speculative blocks the drafter runs first and its drafts are written into
the block's input rows on the device, so drafting, verification and acceptance need no sync.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dspark.models.drafter import Drafter
from dspark.models.layers.cpu_kernels import greedy_tokens
from dspark.models.llama import CausalLM, ModelOutput
from dspark.models.model_config import ModelConfig
from dspark.outputs import TokenLogprobs
from dspark.sampling_params import SamplingParams
from dspark.spec.allocate import allocate
from dspark.spec.draft import append_context, propose
from dspark.spec.sampler import SamplingTensors, sample
from dspark.spec.sts import survival as cumulative_survival
from dspark.spec.types import DraftProposal
from dspark.spec.verify import accept, accept_greedy
from dspark.worker.deferred_context import DeferredContext
from dspark.worker.draft_graphs import DraftGraphs, build_draft_graphs
from dspark.worker.graphs import StepGraphs, dummy_metadata
from dspark.worker.inputs import RequestChunk, StepInputs, build_inputs
from dspark.worker.kv_cache import allocate_kv_cache
from dspark.worker.logprobs import LogprobCollector, PromptLogprobRows, split_logits
from dspark.worker.penalties import penalised_logits
from dspark.worker.step_key import StepKey


@dataclass
class WorkerBatch:
    chunks: list[RequestChunk]
    params: list[SamplingParams]                  # one per chunk that samples, in chunk order
    generators: list[torch.Generator | None]
    spec: list[bool]                              # per sampling chunk: a speculative block?
    verify_budget: int | None = None              # drafts to verify in total (None: all of them)
    request_ids: list[str] | None = None          # per sampling chunk (dummy rows are told apart)
    released_blocks: list[int] | None = None      # KV blocks freed since the last step
    prompt_logprobs: list[PromptLogprobRows] | None = None   # chunks returning prompt log-probs


@dataclass
class StepResult:
    tokens: list[list[int]]                       # per sampling chunk: the tokens to commit
    num_accepted: list[int]                       # per sampling chunk: accepted drafts (0 if plain)
    confidence_logits: list[list[float]] | None = None   # per spec chunk: z_k
    spec_rows: list[bool] | None = None           # per sampling chunk: was it speculative
    verify_lens: list[int] | None = None          # per sampling chunk: drafts verified (0 if plain)
    logprobs: dict[int, list[TokenLogprobs]] | None = None          # per sampling chunk that asked:
                                                  #   one entry per row (anchor + γ for a block)
    prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None   # per chunk that asked


class Worker:
    def __init__(self, model: CausalLM, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, drafter: Drafter | None = None,
                 graphs: StepGraphs | None = None, max_num_seqs: int | None = None):
        self.model = model
        self.graphs = graphs                                  # None: unpadded eager forward
        self.config = config
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_cache(config, num_blocks, block_size, dtype, device)
        if graphs is not None:
            graphs.capture(self.kv_caches, block_size)
        self.drafter = drafter
        self.sts_temperatures: torch.Tensor | None = None    # [γ] applied before allocation
        self.sts_offsets: torch.Tensor | None = None         # [γ]
        self.dummy_steps = 0                                  # idle data-parallel steps run
        self.draft_kv = None
        self.draft_graphs: DraftGraphs | None = None          # None: the draft step runs unpadded
        self.deferred = DeferredContext(num_blocks, block_size, device)   # rows of undrafted steps
        if drafter is not None:
            self.draft_kv = allocate_kv_cache(drafter.config, num_blocks, block_size, dtype, device)
            if graphs is not None:                            # the draft step in the target's mode
                self.draft_graphs = build_draft_graphs(drafter, graphs, num_blocks, block_size,
                                                       config.max_position_embeddings, max_num_seqs)
                self.draft_graphs.capture(self.draft_kv)

    @torch.inference_mode()
    def execute(self, batch: WorkerBatch, key: StepKey | None = None) -> StepResult:
        """Run one step; `key` (a data-parallel group's agreement) fixes its graph buckets."""
        if self.drafter is not None:
            self.deferred.release(batch.released_blocks)
        st = SamplingTensors.build(batch.params, batch.generators, self.config.vocab_size, self.device)
        spec_idx = [i for i, s in enumerate(batch.spec) if s]
        proposal = lens = None
        if spec_idx:
            self.deferred.flush(self.drafter, self.draft_kv)                       # the drafter reads all context
            sampling = [c for c in batch.chunks if c.num_logits > 0]
            ids = [batch.request_ids[i] for i in spec_idx] if batch.request_ids is not None else None
            proposal = self._draft(sampling, spec_idx, st, ids, key)
            batch, lens = self._verify_lengths(batch, sampling, spec_idx, proposal)
        inputs = build_inputs(batch.chunks, self.block_size, self.device, self.config.sliding_window)
        sampling = [c for c in batch.chunks if c.num_logits > 0]
        if spec_idx:
            self._place_drafts(inputs, batch.chunks, spec_idx, proposal.tokens)
        out = self.forward(inputs, key)
        if self.drafter is not None:
            self._append_context(out.aux_hidden, inputs, drafted=bool(spec_idx))
        return self._accept(out.logits, batch, sampling, spec_idx, proposal, st, lens)

    def _verify_lengths(self, batch: WorkerBatch, sampling: list[RequestChunk], spec_idx: list[int],
                        proposal: DraftProposal) -> tuple[WorkerBatch, torch.Tensor]:
        """[R_spec] drafts each block verifies: all of them, or under a verify budget the
        allocator's choice from the current confidences. The lengths are read back and the
        step laid out with the verified rows alone (its inputs are built after the drafter
        pass): a layout padded to every draft with the unverified rows masked costs attention
        and metadata for rows that are never read."""
        caps = [len(sampling[i].token_ids) - 1 for i in spec_idx]
        cap_tensor = torch.tensor(caps, device=self.device)
        if batch.verify_budget is None or batch.verify_budget >= sum(caps):
            return batch, cap_tensor
        lens = allocate(self._survival(proposal, cap_tensor), batch.verify_budget)
        return _trimmed(batch, spec_idx, lens.tolist()), lens

    def _append_context(self, aux_hidden: torch.Tensor, inputs: StepInputs, drafted: bool) -> None:
        """The step's rows into the drafter's context: now after a drafting step (the next one
        most likely drafts too; the held rows went before its drafter pass), else held for the
        next drafting step's one append."""
        attn = inputs.attn
        args = (aux_hidden, inputs.positions, attn.write_rows, attn.write_slots)
        if not drafted:
            if not self.deferred.fits(aux_hidden, attn.write_rows):
                self.deferred.make_room(self.drafter, self.draft_kv)
            if self.deferred.fits(aux_hidden, attn.write_rows):
                self.deferred.hold(*args)
                return
            self.deferred.flush(self.drafter, self.draft_kv)                     # held rows go first
        append_context(self.drafter, self.draft_kv, *args)

    def sync_draft_context(self) -> None:
        """Append the held context rows now (the drafter's cache as a drafting step would see it)."""
        if self.drafter is not None:
            self.deferred.flush(self.drafter, self.draft_kv)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.drafter.config.target_layer_ids if self.drafter is not None else ()

    def forward(self, inputs: StepInputs, key: StepKey | None = None) -> ModelOutput:
        """The target over a step's rows: at its graph bucket when there are graphs (the agreed
        one under data parallelism)."""
        args = (inputs.input_ids, inputs.positions, inputs.attn, self.kv_caches)
        if self.graphs is None:
            x, aux = self.model.forward_hidden(*args, self.aux_layer_ids)
        elif key is None:
            x, aux = self.graphs.run(*args)
        elif key.tokens is None:
            x, aux = self.graphs.run_unpadded(*args)
        else:
            x, aux = self.graphs.run(*args, bucket=key.tokens, use_runner=key.captured)
        return self.model.compute_logits(x, inputs.logits_indices, aux)

    @torch.inference_mode()
    def dummy_step(self, key: StepKey) -> None:
        """An idle data-parallel rank's share of a step: the agreed key run on dummies alone
        (no live row, no K/V write, outputs dropped), so its peers' graphs have a partner."""
        if key.idle or self.graphs is None:
            return
        bucket = key.tokens if key.tokens is not None else self.graphs.buckets[-1]
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        if self.draft_graphs is not None and key.draft_reqs in self.draft_graphs.buffers:
            self.draft_graphs.run(self.draft_kv, empty, empty, empty.view(0, 1), bucket=key.draft_reqs,
                                  table_width=key.table_width)
        self.graphs.run(empty, empty, dummy_metadata(self.block_size, self.device), self.kv_caches,
                        bucket=bucket, use_runner=key.captured)
        self.dummy_steps += 1

    def step_shape(self, batch: WorkerBatch) -> tuple[int, int, int, int]:
        """(requests, target rows after the verify budget, draft requests, widest block table)
        of a batch, known on the host before it runs: what a rank reports for agreement."""
        sampling = [c for c in batch.chunks if c.num_logits > 0]
        caps = sum(len(sampling[i].token_ids) - 1 for i, s in enumerate(batch.spec) if s)
        tokens = sum(len(c.token_ids) for c in batch.chunks)
        if batch.verify_budget is not None and batch.verify_budget < caps:
            tokens -= caps - batch.verify_budget
        width = max(len(c.block_table) for c in batch.chunks)
        return len(batch.chunks), tokens, sum(batch.spec), width

    def _survival(self, proposal, caps: torch.Tensor) -> torch.Tensor:
        """[R, γ] current cumulative survival (STS applied); slots past a request's cap get -1,
        below any real survival, so the allocator fills them last."""
        z = proposal.confidence_logits
        if z is None:
            raise ValueError("confidence scheduling needs a drafter with a confidence head")
        temps = self.sts_temperatures if self.sts_temperatures is not None else torch.ones_like(z[0])
        survival = cumulative_survival(z, temps, self.sts_offsets)
        beyond = torch.arange(z.shape[1], device=z.device)[None, :] >= caps[:, None]
        return survival.masked_fill(beyond, -1.0)

    def _draft(self, sampling: list[RequestChunk], spec_idx: list[int], st: SamplingTensors,
               request_ids: list[str] | None = None, key: StepKey | None = None) -> DraftProposal:
        """The drafter over the speculative requests, at their request bucket when there are
        draft graphs; a data-parallel `key` forces the padded shape."""
        chunks = [sampling[i] for i in spec_idx]
        anchors = torch.tensor([c.token_ids[0] for c in chunks], device=self.device)
        starts = torch.tensor([c.start for c in chunks], device=self.device)
        width = max(len(c.block_table) for c in chunks)
        tables = torch.tensor([c.block_table + [0] * (width - len(c.block_table)) for c in chunks],
                              device=self.device)
        if self.draft_graphs is None:
            return propose(self.drafter, self.draft_kv, anchors, starts, tables, self.block_size,
                           st.select(spec_idx))
        bucket, width = None, None
        if key is not None and key.draft_reqs in self.draft_graphs.buffers:   # else above every bucket
            bucket, width = key.draft_reqs, key.table_width
        return self.draft_graphs.run(self.draft_kv, anchors, starts, tables, st.select(spec_idx),
                                     request_ids, bucket=bucket, table_width=width).proposal

    def _place_drafts(self, inputs: StepInputs, chunks: list[RequestChunk], spec_idx: list[int],
                      drafts: torch.Tensor) -> None:
        """Write each block's first ℓ drafts into its input rows (rows after the anchor)."""
        rows, src = [], []
        offsets = _sampling_offsets(chunks)
        sampling = [c for c in chunks if c.num_logits > 0]
        for j, i in enumerate(spec_idx):
            verify_len = len(sampling[i].token_ids) - 1
            rows += [offsets[i] + 1 + k for k in range(verify_len)]
            src += [j * drafts.shape[1] + k for k in range(verify_len)]
        if rows:
            index = torch.tensor(rows, device=self.device)
            inputs.input_ids.index_copy_(0, index, drafts.flatten()[torch.tensor(src, device=self.device)])

    def _accept(self, logits, batch, sampling, spec_idx, proposal, st, lens) -> StepResult:
        logits, prompt_logits = split_logits(logits, batch.chunks)
        raw, logits = logits, penalised_logits(    # penalties for sampling; log-probs read raw rows
            logits, [c.history for c in sampling], batch.params, [c.num_logits for c in sampling],
            batch.spec, proposal.tokens if proposal is not None else None)
        wanted = LogprobCollector()
        if prompt_logits is not None:
            wanted.add_prompt(prompt_logits, batch.prompt_logprobs)
        counts = [c.num_logits for c in sampling]
        plain_idx = [i for i, s in enumerate(batch.spec) if not s]
        parts = []
        if plain_idx:
            last = torch.tensor(_last_rows(counts, plain_idx), device=self.device)
            tokens = sample(logits[last], st.select(plain_idx))
            parts.append(tokens)
            self._want(wanted, batch.params, plain_idx, raw, last, tokens)
        if spec_idx:
            width = proposal.tokens.shape[1] + 1
            block_rows = torch.tensor(_block_rows(counts, spec_idx, width), device=self.device)  # [R, γ+1]
            spec_st = st.select(spec_idx)
            if spec_st.all_greedy:
                res = accept_greedy(greedy_tokens(logits)[block_rows], lens, proposal)
            else:
                res = accept(logits[block_rows], lens, proposal, spec_st)
            parts += [res.num_accepted, lens, res.tokens.flatten()]
            if proposal.confidence_logits is not None:
                parts.append(proposal.confidence_logits.flatten())
            self._want(wanted, batch.params, spec_idx, raw, block_rows, res.tokens)
        if not parts and not wanted.parts:   # only prefill chunks that do not reach a prompt's end
            return StepResult(tokens=[], num_accepted=[], spec_rows=[])
        flat = torch.cat([p.float() for p in parts + wanted.parts]).tolist()   # the step's one copy
        result = _unpack(flat, batch.spec, plain_idx, spec_idx, proposal)
        if wanted.groups:
            result.logprobs, result.prompt_logprobs = wanted.unpack(flat[len(flat) - wanted.size:])
        return result

    @staticmethod
    def _want(wanted: LogprobCollector, params: list[SamplingParams], chunks: list[int],
              logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The log-probs of the sampling `chunks` that ask for them, from their logits `rows`
        ([R] plain, [R, γ+1] blocks) and committed tokens (same shape; row j of a block
        commits token j). Nothing is gathered when none of them asks."""
        asking = [j for j, i in enumerate(chunks) if params[i].logprobs is not None]
        if not asking:
            return
        pick = torch.tensor(asking, device=logits.device)
        wanted.add(logits[rows.index_select(0, pick).flatten()], tokens.index_select(0, pick).flatten(),
                   [chunks[j] for j in asking], [params[chunks[j]].logprobs for j in asking])


def _chunk_starts(counts: list[int]) -> list[int]:
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return starts


def _last_rows(counts: list[int], chunks: list[int]) -> list[int]:
    """The logits row each plain chunk samples from (its last)."""
    starts = _chunk_starts(counts)
    return [starts[i] + counts[i] - 1 for i in chunks]


def _block_rows(counts: list[int], blocks: list[int], width: int) -> list[list[int]]:
    """The logits rows of each speculative block, `width` (γ+1) per block; a block with fewer
    verified rows repeats its last one (positions past its verify length, never read)."""
    starts = _chunk_starts(counts)
    return [[starts[i] + min(k, counts[i] - 1) for k in range(width)] for i in blocks]


def _sampling_offsets(chunks: list[RequestChunk]) -> list[int]:
    """Flat row of each sampling chunk's first token (non-sampling chunks lie in between)."""
    offsets, row = [], 0
    for c in chunks:
        if c.num_logits > 0:
            offsets.append(row)
        row += len(c.token_ids)
    return offsets


def _trimmed(batch: WorkerBatch, spec_idx: list[int], verify_lens: list[int]) -> WorkerBatch:
    """The batch with each speculative block cut to its anchor and its verified drafts."""
    keep = dict(zip(spec_idx, verify_lens))
    chunks, k = [], 0
    for chunk in batch.chunks:
        if chunk.num_logits > 0 and k in keep:
            rows = 1 + keep[k]
            chunk = dataclasses.replace(chunk, token_ids=chunk.token_ids[:rows], num_logits=rows)
        k += int(chunk.num_logits > 0)
        chunks.append(chunk)
    return dataclasses.replace(batch, chunks=chunks)


def _unpack(flat: list[float], spec_flags, plain_idx, spec_idx, proposal) -> StepResult:
    n_plain, n_spec = len(plain_idx), len(spec_idx)
    tokens: list[list[int]] = [[] for _ in spec_flags]
    accepted, verified = [0] * len(spec_flags), [0] * len(spec_flags)
    for j, i in enumerate(plain_idx):
        tokens[i] = [int(flat[j])]
    conf = None
    if n_spec:
        gamma = proposal.tokens.shape[1]
        base = n_plain + 2 * n_spec
        for j, i in enumerate(spec_idx):
            a = int(flat[n_plain + j])
            accepted[i], verified[i] = a, int(flat[n_plain + n_spec + j])
            tokens[i] = [int(t) for t in flat[base + j * (gamma + 1): base + j * (gamma + 1) + a + 1]]
        if proposal.confidence_logits is not None:
            start = base + n_spec * (gamma + 1)
            conf = [flat[start + j * gamma: start + (j + 1) * gamma] for j in range(n_spec)]
    return StepResult(tokens=tokens, num_accepted=accepted, confidence_logits=conf,
                      spec_rows=list(spec_flags), verify_lens=verified)
