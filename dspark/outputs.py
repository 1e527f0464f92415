"""What the engine hands back: finished (or streaming) requests and their timings."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's log-probabilities as vLLM returns them: token id -> log-prob under the target's
# raw logits (before temperature or truncation), the chosen token first, then the top ones.
TokenLogprobs = dict[int, float]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def tpot(self, num_output_tokens: int) -> float | None:
        if self.finished_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass
class SpecStats:
    """Speculative decoding counters (drafted / verified / accepted); zero for plain decoding."""
    draft_rounds: int = 0
    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    undrafted_steps: int = 0       # decode steps the speculation policy ran without drafting
    predicted_accepted_tokens: float = 0.0   # drafts the policy expected to be accepted (engine-wide)

    @classmethod
    def total(cls, stats) -> "SpecStats":
        """The counters of several requests or ranks added up (per position too)."""
        stats = list(stats)
        width = max((len(s.accepted_per_position) for s in stats), default=0)
        out = cls(accepted_per_position=[0] * width)
        for s in stats:
            out.draft_rounds += s.draft_rounds
            out.drafted_tokens += s.drafted_tokens
            out.verified_tokens += s.verified_tokens
            out.accepted_tokens += s.accepted_tokens
            out.undrafted_steps += s.undrafted_steps
            out.predicted_accepted_tokens += s.predicted_accepted_tokens
            for i, a in enumerate(s.accepted_per_position):
                out.accepted_per_position[i] += a
        return out

    @property
    def acceptance_rate(self) -> float:
        """Accepted over verified drafts (trimmed drafts are not rejections)."""
        return self.accepted_tokens / self.verified_tokens if self.verified_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens committed per round (accepted drafts + the recovered or bonus token)."""
        return 1.0 + self.accepted_tokens / self.draft_rounds if self.draft_rounds else 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None      # the stop string or stop token id that ended it
    metrics: RequestMetrics
    spec: SpecStats = field(default_factory=SpecStats)
    new_text: str = ""                 # text added since the previous output (streaming)
    new_token_ids: list[int] = field(default_factory=list)
    error: str | None = None           # why the engine failed this request (finish_reason "error")
    logprobs: list[TokenLogprobs] | None = None       # per generated token (params.logprobs set)
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # per prompt token, the first None
