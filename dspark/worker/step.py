"""The step boundary: what the engine hands the worker (WorkerBatch), where each sampling
request's rows lie once the step is laid out (StepLayout), and what comes back (StepResult).

Everything per request is indexed one way: the step's sampling requests in chunk order (chunks
that only prefill sample nothing and lie outside it). Plain rows and speculative blocks are told
apart by `spec`, never by a second index.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.outputs import TokenLogprobs
from dspark.sampling_params import SamplingParams
from dspark.spec.sampler import NoiseKey
from dspark.worker.inputs import RequestChunk
from dspark.worker.logprobs import PromptLogprobRows


@dataclass
class WorkerBatch:
    chunks: list[RequestChunk]
    params: list[SamplingParams]                  # [S] one per sampling request
    keys: list[NoiseKey | None]                   # [S] seeded sampling rows: their noise
    spec: list[bool]                              # [S] a speculative block?
    verify_budget: int | None = None              # drafts to verify in total (None: all of them)
    released_blocks: list[int] | None = None      # KV blocks freed since the last step
    prompt_logprobs: list[PromptLogprobRows] | None = None   # chunks returning prompt log-probs

    @property
    def sampling(self) -> list[RequestChunk]:
        """[S] the chunks that sample, in chunk order."""
        return [c for c in self.chunks if c.num_logits > 0]


@dataclass(frozen=True)
class StepLayout:
    """Where each sampling request's rows lie: in the step's input (its first row: the last
    prefill token, the decode token, or a block's anchor) and among the sampled logits."""
    input_rows: tuple[int, ...]       # [S] flat input row of its first sampled row
    logit_rows: tuple[int, ...]       # [S] its first row among the sampled logits
    num_rows: tuple[int, ...]         # [S] rows it samples: 1 (plain) or 1 + its verify length
    spec: tuple[bool, ...]            # [S] a speculative block?

    @classmethod
    def of(cls, batch: WorkerBatch) -> "StepLayout":
        input_rows, logit_rows, num_rows, row, logit = [], [], [], 0, 0
        for c in batch.chunks:
            if c.num_logits > 0:
                input_rows.append(row + len(c.token_ids) - c.num_logits)
                logit_rows.append(logit)
                num_rows.append(c.num_logits)
                logit += c.num_logits
            row += len(c.token_ids)
        return cls(tuple(input_rows), tuple(logit_rows), tuple(num_rows), tuple(batch.spec))

    @property
    def plain(self) -> list[int]:
        return [i for i, s in enumerate(self.spec) if not s]

    @property
    def blocks(self) -> list[int]:
        return [i for i, s in enumerate(self.spec) if s]

    def last_rows(self) -> list[int]:
        """The logits row each plain request samples from."""
        return [self.logit_rows[i] + self.num_rows[i] - 1 for i in self.plain]

    def block_rows(self, width: int) -> list[list[int]]:
        """[R_spec, width] the logits rows of each block, `width` (γ+1) per block; a block with
        fewer verified rows repeats its last one (positions past its verify length, never read)."""
        return [[self.logit_rows[i] + min(k, self.num_rows[i] - 1) for k in range(width)]
                for i in self.blocks]

    def draft_rows(self) -> list[int]:
        """The input rows each block's verified drafts go to (after its anchor), block by block."""
        return [self.input_rows[i] + 1 + k for i in self.blocks for k in range(self.num_rows[i] - 1)]


@dataclass
class StepResult:
    tokens: list[list[int]]                       # [S] the tokens to commit
    num_accepted: list[int]                       # [S] accepted drafts (0 if plain)
    verify_lens: list[int]                        # [S] drafts verified (0 if plain)
    confidence_logits: list[list[float] | None]   # [S] a block's z_k (None: plain, or no head)
    logprobs: dict[int, list[TokenLogprobs]] | None = None          # [S]-indexed, those that asked:
                                                  #   one entry per row (anchor + γ for a block)
    prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None   # per chunk that asked

