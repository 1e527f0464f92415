"""What the engine hands back: finished (or streaming) requests and their timings."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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

    def add_round(self, gamma: int, verified: int, accepted: int) -> None:
        """One draft round of a block of γ drafts, `verified` of them verified, `accepted` accepted."""
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * gamma
        self.draft_rounds += 1
        self.drafted_tokens += gamma
        self.verified_tokens += verified
        self.accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_position[pos] += 1

    def since(self, before: "SpecStats") -> "SpecStats":
        """The counters added since `before` (clamped at zero should the totals be reset meanwhile)."""
        def diff(a: int, b: int) -> int:
            return max(0, a - b)

        old = before.accepted_per_position
        positions = [diff(a, old[i] if i < len(old) else 0) for i, a in enumerate(self.accepted_per_position)]
        return SpecStats(draft_rounds=diff(self.draft_rounds, before.draft_rounds),
                         drafted_tokens=diff(self.drafted_tokens, before.drafted_tokens),
                         verified_tokens=diff(self.verified_tokens, before.verified_tokens),
                         accepted_tokens=diff(self.accepted_tokens, before.accepted_tokens),
                         accepted_per_position=positions,
                         undrafted_steps=diff(self.undrafted_steps, before.undrafted_steps),
                         predicted_accepted_tokens=max(0.0, self.predicted_accepted_tokens
                                                       - before.predicted_accepted_tokens))

    @property
    def drafted_share(self) -> float:
        """Request decode steps that drafted, of all of them (the rest the policy left plain)."""
        return self.draft_rounds / max(1, self.draft_rounds + self.undrafted_steps)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over verified drafts (trimmed drafts are not rejections)."""
        return self.accepted_tokens / self.verified_tokens if self.verified_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens committed per round (accepted drafts + the recovered or bonus token)."""
        return 1.0 + self.accepted_tokens / self.draft_rounds if self.draft_rounds else 0.0


@dataclass
class CompletionOutput:
    """One of a request's n completions (vLLM's CompletionOutput); `index` is its place in 0..n-1."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None    # sum of the chosen tokens' log-probs (logprobs asked)


@dataclass
class RequestOutput:
    """A request's output. With `SamplingParams.n > 1` the engine streams one output per completion
    (`request_id` the child's, `index` its place) and `LLM.generate` merges each request's into one
    whose `outputs` holds all n in index order; `text`, `token_ids`, `finish_reason`,
    `stop_reason` and `logprobs` stay those of the first completion, so n = 1 code is unchanged."""
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
    index: int = 0                     # which of the request's n completions this is
    completions: list[CompletionOutput] | None = None   # all n (merged outputs); None: this one

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: every completion of the request (one unless merged from n children)."""
        if self.completions is not None:
            return self.completions
        cumulative = None if self.logprobs is None else sum(
            next(iter(entry.values())) for entry in self.logprobs if entry)
        return [CompletionOutput(self.index, self.text, self.token_ids, self.finish_reason,
                                 self.stop_reason, self.logprobs, cumulative)]


def merge_outputs(request_id: str, outputs: list[RequestOutput]) -> RequestOutput:
    """The finished outputs of one request's completions (in index order) as one output:
    `outputs` holds them all, the flat fields stay the first one's, the counters add up."""
    def known(name: str) -> list[float]:
        return [t for o in outputs if (t := getattr(o.metrics, name)) is not None]
    first = outputs[0]
    metrics = RequestMetrics(
        arrival_time=first.metrics.arrival_time,
        first_scheduled_time=min(known("first_scheduled_time"), default=None),
        first_token_time=min(known("first_token_time"), default=None),
        finished_time=max(known("finished_time"), default=None),
        num_preemptions=sum(o.metrics.num_preemptions for o in outputs))
    return replace(first, request_id=request_id, metrics=metrics,
                   spec=SpecStats.total(o.spec for o in outputs),
                   completions=[o.outputs[0] for o in outputs])
