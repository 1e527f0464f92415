"""Owns the target's and drafter's KV caches and a step's device work; one wait for the device a
step, when its results are read (`host_copy.to_host`).

A step's chunks are prefill chunks, plain decode tokens and speculative blocks, all in one ragged
target forward. For speculative blocks the drafter runs first and its drafts are written into
the block's input rows on the device, so drafting, verification and acceptance need no other
wait, except where a verify budget trims the blocks: their lengths are read back first.
"""

from __future__ import annotations

import dataclasses

import torch

from dspark.host_copy import device_tensor, to_host
from dspark.kernels.cpu import greedy_tokens
from dspark.models.drafter import Drafter
from dspark.models.kv_cache import allocate_kv_cache
from dspark.models.llama import CausalLM, ModelOutput
from dspark.models.model_config import ModelConfig
from dspark.runner.runner import Runner
from dspark.runner.step_key import StepKey
from dspark.sampling_params import SamplingParams
from dspark.spec.planner import allocate
from dspark.spec.sampler import SamplingTensors, sample
from dspark.spec.sts import survival as cumulative_survival
from dspark.spec.types import DraftProposal
from dspark.spec.verify import accept, accept_greedy
from dspark.worker.deferred_context import DeferredContext
from dspark.worker.inputs import RequestChunk, StepInputs, build_inputs, padded_tables
from dspark.worker.logprobs import LogprobCollector, split_logits
from dspark.worker.penalties import penalised_logits
from dspark.worker.step import StepLayout, StepResult, WorkerBatch


class Worker:
    def __init__(self, model: CausalLM, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, runner: Runner, drafter: Drafter | None = None):
        self.model = model
        self.runner = runner                                  # how the forwards run (runner/)
        self.config = config
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_cache(config, num_blocks, block_size, dtype, device)
        self.drafter = drafter
        self.sts_temperatures: torch.Tensor | None = None    # [γ] applied before allocation
        self.sts_offsets: torch.Tensor | None = None         # [γ]
        self.deferred = DeferredContext(num_blocks, block_size, device)   # rows of undrafted steps
        self.draft_kv = None if drafter is None else allocate_kv_cache(
            drafter.config, num_blocks, block_size, dtype, device)
        runner.capture(self.kv_caches, self.draft_kv, num_blocks, block_size)

    @torch.inference_mode()
    def execute(self, batch: WorkerBatch, key: StepKey | None = None) -> StepResult:
        """Run one step; `key` (a data-parallel group's agreement) fixes its graph buckets."""
        if self.drafter is not None:
            self.deferred.release(batch.released_blocks)
        st = SamplingTensors.build(batch.params, batch.keys, self.config.vocab_size, self.device)
        blocks = [i for i, s in enumerate(batch.spec) if s]
        proposal = lens = None
        if blocks:
            drafting = {b for i in blocks for b in batch.sampling[i].block_table}
            self.deferred.flush(self._append, device_tensor(sorted(drafting), torch.long, self.device))
            proposal = self._draft(batch.sampling, blocks, st, key)
            batch, lens = self._verify_lengths(batch, blocks, proposal)
        layout = StepLayout.of(batch)
        inputs = build_inputs(batch.chunks, self.block_size, self.device, self.config.sliding_window)
        if blocks:
            self._place_drafts(inputs, layout, proposal.tokens)
        out = self.forward(inputs, key)
        if self.drafter is not None:
            self._append_context(out.aux_hidden, inputs, drafted=bool(blocks))
        return self._accept(out.logits, batch, layout, proposal, st, lens)

    def _verify_lengths(self, batch: WorkerBatch, blocks: list[int],
                        proposal: DraftProposal) -> tuple[WorkerBatch, torch.Tensor]:
        """[R_spec] drafts each block verifies: all, or under a verify budget the allocator's
        choice from the current confidences, read back so that the step's inputs hold the
        verified rows alone (padded rows would cost attention, docs/measurements.md)."""
        sampling = batch.sampling
        caps = [len(sampling[i].token_ids) - 1 for i in blocks]
        cap_tensor = device_tensor(caps, torch.long, self.device)
        if batch.verify_budget is None or batch.verify_budget >= sum(caps):
            return batch, cap_tensor
        lens = allocate(self._survival(proposal, cap_tensor), batch.verify_budget)
        return _trimmed(batch, blocks, lens.tolist()), lens

    def _append_context(self, aux_hidden: torch.Tensor, inputs: StepInputs, drafted: bool) -> None:
        """The step's rows into the drafter's context: now after a drafting step (the next one
        most likely drafts too; the held rows went before its drafter pass), else held for the
        next drafting step's one append."""
        attn = inputs.attn
        args = (aux_hidden, inputs.positions, attn.write_rows, attn.write_slots)
        if not drafted:
            if not self.deferred.fits(aux_hidden, attn.write_rows):
                self.deferred.make_room(self._append)
            if self.deferred.fits(aux_hidden, attn.write_rows):
                self.deferred.hold(*args)
                return
            self.deferred.flush(self._append)                                   # held rows go first
        self._append(*args)

    def _append(self, aux_hidden: torch.Tensor, positions: torch.Tensor, write_rows: torch.Tensor | None,
                write_slots: torch.Tensor) -> None:
        self.runner.append_context(self.draft_kv, aux_hidden, positions, write_rows, write_slots)

    def forward(self, inputs: StepInputs, key: StepKey | None = None) -> ModelOutput:
        """The target over a step's rows, as the runner runs it (at the agreed data-parallel key)."""
        x, aux = self.runner.forward(inputs.input_ids, inputs.positions, inputs.attn, self.kv_caches, key)
        return self.model.compute_logits(x, inputs.logits_indices, aux)

    @torch.inference_mode()
    def dummy_step(self, key: StepKey) -> None:
        """An idle data-parallel rank's share of a step (Runner.dummy_step)."""
        self.runner.dummy_step(key, self.kv_caches, self.draft_kv)

    def step_shape(self, batch: WorkerBatch) -> tuple[int, int, int, int]:
        """(requests, target rows after the verify budget, draft requests, widest block table)
        of a batch, known on the host before it runs: what a rank reports for agreement."""
        caps = sum(len(c.token_ids) - 1 for c, s in zip(batch.sampling, batch.spec) if s)
        tokens = sum(len(c.token_ids) for c in batch.chunks)
        if batch.verify_budget is not None and batch.verify_budget < caps:
            tokens -= caps - batch.verify_budget
        width = max(len(c.block_table) for c in batch.chunks)
        return len(batch.chunks), tokens, sum(batch.spec), width

    def _survival(self, proposal, caps: torch.Tensor) -> torch.Tensor:
        """[R, γ] current cumulative survival (STS applied); slots past a request's cap get -1,
        below any real survival, so the allocator fills them last."""
        z = proposal.confidence_logits          # a verify budget comes from a policy, which needs the head
        temps = self.sts_temperatures if self.sts_temperatures is not None else torch.ones_like(z[0])
        survival = cumulative_survival(z, temps, self.sts_offsets)
        beyond = torch.arange(z.shape[1], device=z.device)[None, :] >= caps[:, None]
        return survival.masked_fill(beyond, -1.0)

    def _draft(self, sampling: list[RequestChunk], spec_idx: list[int], st: SamplingTensors,
               key: StepKey | None = None) -> DraftProposal:
        """The drafter over the speculative requests (Runner.draft)."""
        chunks = [sampling[i] for i in spec_idx]
        anchors = device_tensor([c.token_ids[0] for c in chunks], torch.long, self.device)
        starts = device_tensor([c.start for c in chunks], torch.long, self.device)
        tables = device_tensor(padded_tables(chunks), torch.long, self.device)
        return self.runner.draft(self.draft_kv, anchors, starts, tables, st.select(spec_idx), key)

    def _place_drafts(self, inputs: StepInputs, layout: StepLayout, drafts: torch.Tensor) -> None:
        """Write each block's verified drafts [R, γ] into its input rows (after its anchor)."""
        rows = layout.draft_rows()
        if rows:
            gamma = drafts.shape[1]
            src = [j * gamma + k for j, i in enumerate(layout.blocks) for k in range(layout.num_rows[i] - 1)]
            index = device_tensor(rows, torch.long, self.device)
            inputs.input_ids.index_copy_(0, index, drafts.flatten()[device_tensor(src, torch.long, self.device)])

    def _accept(self, logits: torch.Tensor, batch: WorkerBatch, layout: StepLayout,
                proposal: DraftProposal | None, st: SamplingTensors, lens: torch.Tensor | None) -> StepResult:
        """Sample the plain rows, accept or reject each block's drafts, gather the log-probs
        asked for; then the step's one wait for the device (to_host)."""
        logits, prompt_logits = split_logits(logits, batch.chunks)
        raw, logits = logits, penalised_logits(    # penalties for sampling; log-probs read raw rows
            logits, [c.history for c in batch.sampling], batch.params, list(layout.num_rows),
            batch.spec, proposal.tokens if proposal is not None else None)
        wanted = LogprobCollector()
        if prompt_logits is not None:
            wanted.add_prompt(prompt_logits, batch.prompt_logprobs)
        out: dict[str, torch.Tensor] = {}
        if layout.plain:
            last = device_tensor(layout.last_rows(), torch.long, self.device)
            out["plain"] = sample(logits[last], st.select(layout.plain))                 # [P]
            self._want(wanted, batch.params, layout.plain, raw, last, out["plain"])
        if layout.blocks:
            width = proposal.tokens.shape[1] + 1
            block_rows = device_tensor(layout.block_rows(width), torch.long, self.device)   # [R, γ+1]
            spec_st = st.select(layout.blocks)
            if spec_st.all_greedy:
                res = accept_greedy(greedy_tokens(logits)[block_rows], lens, proposal)
            else:
                res = accept(logits[block_rows], lens, proposal, spec_st)
            out |= {"accepted": res.num_accepted, "verified": lens, "blocks": res.tokens}
            if proposal.confidence_logits is not None:
                out["confidence"] = proposal.confidence_logits                          # [R, γ]
            self._want(wanted, batch.params, layout.blocks, raw, block_rows, res.tokens)
        copied = to_host(list(out.values()) + wanted.parts)
        result = _result(layout, dict(zip(out, copied)))
        if wanted.groups:
            result.logprobs, result.prompt_logprobs = wanted.unpack(copied[len(out):])
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
        pick = device_tensor(asking, torch.long, logits.device)
        wanted.add(logits[rows.index_select(0, pick).flatten()], tokens.index_select(0, pick).flatten(),
                   [chunks[j] for j in asking], [params[chunks[j]].logprobs for j in asking])


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


def _result(layout: StepLayout, host: dict[str, list]) -> StepResult:
    """The host copies of the step's result tensors -> per sampling request."""
    n = len(layout.spec)
    result = StepResult(tokens=[[] for _ in range(n)], num_accepted=[0] * n, verify_lens=[0] * n,
                        confidence_logits=[None] * n)
    for j, i in enumerate(layout.plain):
        result.tokens[i] = [host["plain"][j]]
    for j, i in enumerate(layout.blocks):
        accepted = host["accepted"][j]
        result.num_accepted[i], result.verify_lens[i] = accepted, host["verified"][j]
        result.tokens[i] = host["blocks"][j][:accepted + 1]
        if "confidence" in host:
            result.confidence_logits[i] = host["confidence"][j]
    return result
