"""The same engine facts as `metrics.py`, under vLLM's metric names, types and labels.

Dashboards and autoscalers written for vLLM read `vllm:*` series with a `model_name` label; these
let them watch dspark unchanged.  Fed by the same `EngineObserver` hooks as the `dspark_` series,
on the same registry.  Mapping of the speculative counters: a vLLM "draft" is one request's
speculative round and its "draft tokens" are the drafts the target verified, so
`vllm:spec_decode_num_draft_tokens` counts dspark's verified drafts (the drafts a confidence
schedule trims before verification stay in `dspark_spec_drafted_tokens`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dspark.outputs import RequestOutput, SpecStats
from dspark.server.async_engine import EngineState, StepReport

# vLLM's buckets, so that histogram quantiles compare across the two servers
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")     # shown from the start, as vLLM does
LABELS = ["model_name"]


class VllmMetrics:
    """An EngineObserver writing vLLM-named series to `registry`, labelled with the served name."""

    def __init__(self, registry: CollectorRegistry, model_name: str, gamma: int = 0):
        self.model_name = model_name
        self._gauges(registry)
        self._histograms(registry)
        self._counters(registry)
        self.spec = _SpecCounters(registry, model_name, gamma) if gamma > 0 else None

    def _gauges(self, r: CollectorRegistry) -> None:
        name = self.model_name
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution "
                             "batches.", LABELS, registry=r).labels(name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be "
                             "processed.", LABELS, registry=r).labels(name)
        self.gpu_cache = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent "
                               "usage (the older name of vllm:kv_cache_usage_perc).", LABELS,
                               registry=r).labels(name)
        self.kv_cache = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              LABELS, registry=r).labels(name)

    def _histograms(self, r: CollectorRegistry) -> None:
        name = self.model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token "
                              "in seconds.", LABELS, buckets=TTFT_BUCKETS, registry=r).labels(name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency "
                             "in seconds.", LABELS, buckets=REQUEST_BUCKETS, registry=r).labels(name)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in "
                               "WAITING phase for request.", LABELS, buckets=REQUEST_BUCKETS,
                               registry=r).labels(name)

    def _counters(self, r: CollectorRegistry) -> None:
        name = self.model_name
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     LABELS, registry=r).labels(name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens "
                                         "processed.", LABELS, registry=r).labels(name)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*LABELS, "finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.success.labels(name, reason)

    # ---- EngineObserver (engine thread) ---------------------------------------------------------
    def on_step(self, report: StepReport) -> None:
        for out in report.outputs:
            self.generation_tokens.inc(len(out.new_token_ids))
            if out.token_ids and len(out.new_token_ids) == len(out.token_ids):   # its first tokens
                self._on_first_tokens(out)
            if out.finished:
                self._on_finished(out)
        if self.spec is not None:
            self.spec.add(report.spec)

    def _on_first_tokens(self, out: RequestOutput) -> None:
        """The prompt counts once it is prefilled, as vLLM counts it (aborted requests included)."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        if out.metrics.ttft is not None:
            self.ttft.observe(out.metrics.ttft)

    def _on_finished(self, out: RequestOutput) -> None:
        if out.finish_reason != "error":                 # an engine failure is no success
            self.success.labels(self.model_name, str(out.finish_reason)).inc()
        if out.metrics.latency is not None:
            self.e2e.observe(out.metrics.latency)
        scheduled = out.metrics.first_scheduled_time
        if scheduled is not None:
            self.queue.observe(max(0.0, scheduled - out.metrics.arrival_time))

    def on_state(self, state: EngineState) -> None:
        self.running.set(state.running)
        self.waiting.set(state.waiting)
        self.gpu_cache.set(state.kv_usage)
        self.kv_cache.set(state.kv_usage)

    def on_abort(self, request_id: str) -> None:
        self.success.labels(self.model_name, "abort").inc()

    def on_slow_reader(self, request_id: str) -> None:
        pass                                   # its abort follows and is counted there


class _SpecCounters:
    """vLLM's speculative decoding counters (created only when a drafter runs, as in vLLM)."""

    def __init__(self, r: CollectorRegistry, model_name: str, gamma: int):
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                              LABELS, registry=r).labels(model_name)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                    LABELS, registry=r).labels(model_name)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                LABELS, registry=r).labels(model_name)
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
                          "position.", [*LABELS, "position"], registry=r)
        self.per_pos = [per_pos.labels(model_name, str(position)) for position in range(gamma)]

    def add(self, spec: SpecStats) -> None:
        if not spec.draft_rounds:
            return
        self.drafts.inc(spec.draft_rounds)
        self.draft_tokens.inc(spec.verified_tokens)
        self.accepted.inc(spec.accepted_tokens)
        for counter, count in zip(self.per_pos, spec.accepted_per_position):
            counter.inc(count)
