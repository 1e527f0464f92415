"""One request's state as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from dspark.outputs import RequestMetrics, SpecStats, TokenLogprobs
from dspark.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dspark.engine.parallel_sampling import SampleGroup


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0          # tokens whose KV is in the cache
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.perf_counter())
        self.spec = SpecStats()
        self.output_text = ""
        # log-probs collected so far, when asked for (kept across preemption: never recomputed)
        self.output_logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            None if params.prompt_logprobs is None else [None])
        self.sent_text_len = self.sent_token_len = 0      # what outputs have carried so far
        self.index = 0                        # which of its request's n completions (n > 1)
        self.group: SampleGroup | None = None  # the completions sharing its prompt (n > 1)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]
