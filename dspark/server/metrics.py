"""Prometheus metrics: HTTP requests, latencies, engine load and speculative decoding counters.

Each server owns its own CollectorRegistry, so several servers (tests, a benchmark launching one
in-process) never collide on the process-global default registry.  Engine-side metrics are fed
by the engine thread through the `EngineObserver` hooks; prometheus_client is thread-safe.
The same facts under vLLM's names (`vllm:*`) are in `vllm_metrics.py`, on the same registry.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dspark.server.async_engine import EngineState, StepReport

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
VERIFY_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
             "/detokenize", "/version"}


class ServerMetrics:
    def __init__(self, gamma: int = 0):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dspark_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("dspark_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("dspark_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("dspark_request_latency_seconds", "Arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram("dspark_engine_step_seconds", "Duration of one engine step",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("dspark_num_requests_waiting", "Requests queued, not yet running",
                             registry=r)
        self.running = Gauge("dspark_num_requests_running", "Requests in the running batch", registry=r)
        self.kv_usage = Gauge("dspark_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.kv_free = Gauge("dspark_kv_cache_free_blocks", "Free KV blocks", registry=r)
        self.kv_blocks = Gauge("dspark_kv_cache_blocks", "KV blocks in the cache", registry=r)
        self.finished = Counter("dspark_requests_finished", "Requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.aborted = Counter("dspark_requests_aborted", "Requests aborted before finishing "
                               "(client gone)", registry=r)
        self.slow_readers = Counter("dspark_slow_reader_aborts", "Streaming requests aborted because "
                                    "the client stopped reading", registry=r)
        self.prompt_tokens = Counter("dspark_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("dspark_generation_tokens", "Tokens generated", registry=r)
        self.draft_rounds = Counter("dspark_spec_draft_rounds", "Speculative rounds (one per request "
                                    "per speculative step)", registry=r)
        self.drafted = Counter("dspark_spec_drafted_tokens", "Tokens drafted", registry=r)
        self.verified = Counter("dspark_spec_verified_tokens", "Drafted tokens the target verified",
                                registry=r)
        self.accepted = Counter("dspark_spec_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.undrafted = Counter("dspark_spec_undrafted_steps", "Decode steps of speculative requests "
                                 "that the speculation policy ran without drafting", registry=r)
        self.predicted = Counter("dspark_spec_predicted_accepted_tokens", "Drafts the speculation "
                                 "policy expected to be accepted when it planned (against "
                                 "dspark_spec_accepted_tokens: what was)", registry=r)
        self.accepted_at = Counter("dspark_spec_accepted_tokens_per_position",
                                   "Drafts accepted at each block position (1-based)", ["position"],
                                   registry=r)
        self.verify_per_step = Histogram("dspark_spec_verified_tokens_per_step",
                                         "Verify budget used: drafted tokens verified in one step",
                                         buckets=VERIFY_BUCKETS, registry=r)
        self.runner_steps = Counter("dspark_runner_steps", "Forwards by how the runner ran them "
                                    "(graph, eager above the buckets, fused CPU layers, dummy, ...)",
                                    ["kind"], registry=r)
        self._runner_seen: dict[str, int] = {}
        for position in range(1, gamma + 1):        # show every position, even before traffic
            self.accepted_at.labels(position=str(position))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- EngineObserver (engine thread) ---------------------------------------------------------
    def on_step(self, report: StepReport) -> None:
        self.step_seconds.observe(report.seconds)
        for out in report.outputs:
            self.generation_tokens.inc(len(out.new_token_ids))
            if out.token_ids and len(out.new_token_ids) == len(out.token_ids):
                ttft = out.metrics.ttft
                if ttft is not None:
                    self.ttft.observe(ttft)
            if out.finished:
                self._on_finished(out)
        spec = report.spec
        if spec.undrafted_steps:
            self.undrafted.inc(spec.undrafted_steps)
        if spec.predicted_accepted_tokens > 0:
            self.predicted.inc(spec.predicted_accepted_tokens)
        if spec.draft_rounds:
            self.draft_rounds.inc(spec.draft_rounds)
            self.drafted.inc(spec.drafted_tokens)
            self.verified.inc(spec.verified_tokens)
            self.accepted.inc(spec.accepted_tokens)
            self.verify_per_step.observe(spec.verified_tokens)
            for position, count in enumerate(spec.accepted_per_position, start=1):
                if count:
                    self.accepted_at.labels(position=str(position)).inc(count)

    def _on_finished(self, out: Any) -> None:
        self.finished.labels(finish_reason=str(out.finish_reason)).inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        tpot = out.metrics.tpot(len(out.token_ids))
        if tpot is not None:
            self.tpot.observe(tpot)
        if out.metrics.latency is not None:
            self.latency.observe(out.metrics.latency)

    def on_abort(self, request_id: str) -> None:
        self.aborted.inc()

    def on_slow_reader(self, request_id: str) -> None:
        self.slow_readers.inc()

    def on_state(self, state: EngineState) -> None:
        self.waiting.set(state.waiting)
        self.running.set(state.running)
        self.kv_usage.set(state.kv_usage)
        self.kv_free.set(state.free_blocks)
        self.kv_blocks.set(state.num_blocks)
        for kind, total in state.runner.items():     # cumulative totals -> counter increments
            seen = self._runner_seen.get(kind, 0)
            if total > seen:
                self.runner_steps.labels(kind=kind).inc(total - seen)
            self._runner_seen[kind] = total


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class RequestCounter:
    """Pure ASGI middleware counting responses by endpoint and status.

    (Starlette's BaseHTTPMiddleware would wrap streaming bodies and interfere with disconnect
    detection, which the server relies on to abort requests.)
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        status = {"code": 500}

        async def capture(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()
