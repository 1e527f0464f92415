"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both streaming or not), GET /v1/models,
GET /health, GET /metrics, and (extra_routes.py) POST /tokenize, POST /detokenize, GET /version.
Every error answers with an OpenAI error body; see `errors.py` for the shape.  Status codes: 400
bad input (types, values, unsupported parameters, prompt over the context, chat template errors),
401 missing or wrong API key (auth.py), 404 unknown model or route, 429 queue full,
500 engine failure, 503 engine not running or the server shutting down (code
"server_shutting_down"); a client that leaves gets its requests aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dspark.config import EngineConfig, default_model_path
from dspark.engine.engine import Engine
from dspark.generation_config import describe, sampling_defaults
from dspark.sampling_params import SamplingParams
from dspark.server.async_engine import (AsyncEngine, EngineNotRunning, QueueFull, RequestFailed,
                                         RequestStream, ServerShuttingDown)
from dspark.server.auth import ApiKeyAuth
from dspark.server.body_limit import BodyLimit
from dspark.server.chat_template import install_chat_template, load_chat_template
from dspark.server.engine_thread import EngineThread
from dspark.server.errors import APIError, install_error_handlers
from dspark.server.extra_routes import add_extra_routes
from dspark.server.limits import ServerLimits
from dspark.server.logprobs import ChatFormat, CompletionFormat
from dspark.server.metrics import RequestCounter, ServerMetrics
from dspark.server.request_id import RequestIdHeader
from dspark.server.vllm_metrics import VllmMetrics
from dspark.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionRequest, ChatCompletionResponse, CompletionChunk,
                                    CompletionRequest, CompletionResponse, DeltaMessage, ModelCard, ModelList)
from dspark.server.serving import (SHUTTING_DOWN, ChunkBuilder, chat_prompt, check_chat, check_completion,
                                   checked_prompt, collect, completion_prompts, refusal, sampling_params,
                                   spec_info, stream_sse, usage)

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) answer was ready."""


class SSEResponse(StreamingResponse):
    """A streaming response that always watches for the client leaving and then closes the body.

    Closing the body generator runs its `finally`, which aborts the engine requests at once, so
    a disconnected client frees its KV blocks even while no output is being produced.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:   # type: ignore[override]
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()                  # type: ignore[attr-defined]


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone()
    return task.result()


class ServerState:
    """What the routes share: the engine front, the served names (the first is the one responses
    report), the sampling defaults unset request fields take, and the metrics."""

    def __init__(self, async_engine: AsyncEngine, served_model_names: Sequence[str],
                 metrics: ServerMetrics, limits: ServerLimits,
                 sampling_defaults: dict[str, float | int] | None = None):
        if not served_model_names:
            raise ValueError("at least one served model name is required")
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.served_model_names = list(served_model_names)
        self.served_model_name = self.served_model_names[0]
        self.metrics = metrics
        self.limits = limits
        self.sampling_defaults = dict(sampling_defaults or {})

    def checked_prompts(self, prompts: list[str | list[int]], params: SamplingParams,
                        param: str) -> list[list[int]]:
        """Token ids of prompts the engine accepts (a 400 naming the problem otherwise); called
        in a worker thread, so tokenizing a long prompt never blocks the event loop."""
        return [checked_prompt(self.engine.check_request, p, params, param) for p in prompts]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            names = ", ".join(f"'{name}'" for name in self.served_model_names)
            raise APIError(404, f"the model '{model}' does not exist; this server serves {names}",
                           param="model", code="model_not_found")

    async def submit(self, prompts: list[str | list[int]], params: SamplingParams, base_id: str,
                     prompt_param: str) -> list[RequestStream]:
        """Queue every prompt and wait until the engine accepted them all (or none): one stream per
        choice, `params.n` per prompt, choice i * n + j being completion j of prompt i (vLLM's)."""
        streams: list[RequestStream] = []
        try:
            for index, prompt in enumerate(prompts):
                streams += self.async_engine.submit_n(prompt, params, f"{base_id}-{index}")
            results = await asyncio.gather(*(s.accepted for s in streams), return_exceptions=True)
            error = next((r for r in results if isinstance(r, BaseException)), None)
            if error is not None:
                raise error
        except BaseException as exc:
            for stream in streams:
                stream.close()
            mapped = _as_api_error(exc, prompt_param)
            if mapped is exc:
                raise
            raise mapped from exc
        return streams


def _as_api_error(exc: BaseException, prompt_param: str) -> BaseException:
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), code="queue_full")
    if isinstance(exc, (ValueError, TypeError)):
        return refusal(exc, prompt_param)
    if isinstance(exc, RequestFailed):
        return APIError(500, str(exc), code="engine_error")
    if isinstance(exc, ServerShuttingDown):
        return APIError(503, str(exc), code=SHUTTING_DOWN)
    if isinstance(exc, EngineNotRunning):
        return APIError(503, str(exc), code="engine_unavailable")
    return exc


def start_engine(config: EngineConfig) -> Engine:
    """One engine, or rank 0 of a data-parallel group (same interface)."""
    if config.parallel.data_parallel_size > 1:
        from dspark.distributed.group import start_group
        return start_group(config)
    return Engine(config)


def default_served_name(model: str | None) -> str:
    if model is None:
        model = default_model_path()
    name = os.path.basename(model.rstrip("/"))
    if name.endswith(".gguf"):         # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
        name = re.sub(r"\.(q\d\w*|iq\d\w*|f16|f32|bf16)$", "", name[: -len(".gguf")], flags=re.IGNORECASE)
    return name


def build_app(engine: Engine | EngineConfig, served_model_name: str | Sequence[str] | None = None,
              max_queue: int | None = 256,
              on_fatal: Callable[[BaseException], None] | None = None,
              limits: ServerLimits | None = None, api_key: str | None = None,
              chat_template: str | None = None) -> FastAPI:
    """The app owns an engine thread from startup to shutdown (FastAPI lifespan). A config with
    data_parallel_size > 1 starts a group whose rank 0 runs here. `on_fatal` is called when
    the engine can no longer serve (a data-parallel rank failed): the launcher exits non-zero.
    `served_model_name`: one name or several, all accepted; `api_key`: required on the API
    routes; `chat_template`: a Jinja file or inline template replacing the model's."""
    config = engine if isinstance(engine, EngineConfig) else engine.config
    names = _served_names(served_model_name, config.model)      # bad settings fail before loading
    if api_key is not None and not api_key:
        raise ValueError("the API key must not be empty")
    template = load_chat_template(chat_template) if chat_template is not None else None
    defaults = sampling_defaults(config.model, config.generation_config)
    # a warning when the model's values apply, as vLLM does: they change what unset fields mean
    level = logging.WARNING if defaults else logging.INFO
    logger.log(level, "%s", describe(defaults, config.generation_config))
    thread = EngineThread()              # builds the engine it will step (engine_thread.py)
    try:
        engine = thread.submit(_started, engine, template).result()
    except BaseException:
        thread.close()
        raise
    limits = limits or ServerLimits()
    gamma = engine.drafter.config.block_size if engine.drafter is not None else 0
    metrics = ServerMetrics(gamma)
    observers = [metrics, VllmMetrics(metrics.registry, names[0], gamma)]
    async_engine = AsyncEngine(engine, max_queue, observers=observers, on_fatal=on_fatal,
                               max_pending_outputs=limits.max_pending_outputs, thread=thread)
    state = ServerState(async_engine, names, metrics, limits, defaults)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.async_engine.start()
        logger.info("serving %s (max_model_len=%d, gamma=%d)", state.served_model_name,
                    engine.max_model_len, gamma)
        try:
            yield
        finally:
            await state.async_engine.stop()
            await asyncio.to_thread(engine.close)

    app = FastAPI(title="dspark", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_exception_handler(ClientGone, _client_gone)
    _add_middleware(app, limits, metrics, api_key)
    _add_routes(app, state, gamma)
    add_extra_routes(app, state)
    return app


def _started(engine: Engine | EngineConfig, template: str | None) -> Engine:
    """The engine (started here from a config), rendering chats with `template` if given."""
    owned = isinstance(engine, EngineConfig)
    if isinstance(engine, EngineConfig):
        engine = start_engine(engine)
    if template is not None:
        try:
            install_chat_template(engine.tokenizer, template)
        except ValueError:
            if owned:               # a data-parallel group's ranks must not outlive the error
                engine.close()
            raise
    return engine


def _add_middleware(app: FastAPI, limits: ServerLimits, metrics: ServerMetrics, api_key: str | None) -> None:
    """The last added runs first: the request id outermost (every answer carries it), then the
    counter (refusals count too), the key check, and the body limit (strangers learn nothing)."""
    app.add_middleware(BodyLimit, max_bytes=limits.max_request_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(RequestIdHeader)


def _served_names(given: str | Sequence[str] | None, model: str | None) -> list[str]:
    names = [given] if isinstance(given, str) else list(given or [])
    if any(not name for name in names):
        raise ValueError("served model names must not be empty")
    return names or [default_served_name(model)]


def _add_routes(app: FastAPI, state: ServerState, gamma: int) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if not state.async_engine.is_running:
            raise APIError(503, "the engine loop is not running", code="engine_unavailable")
        if state.async_engine.draining:           # a load balancer should send no more here
            raise APIError(503, "the server is shutting down", code=SHUTTING_DOWN)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=state.engine.max_model_len,
                                         speculative=gamma > 0, gamma=gamma)
                               for name in state.served_model_names])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.check_model(body.model)
        check_completion(body, state.limits)
        max_tokens = body.max_tokens if body.max_tokens is not None else state.engine.max_model_len
        params = sampling_params(body, max_tokens, "max_tokens", state.sampling_defaults)
        prompts = completion_prompts(body, state.limits)
        ids = await asyncio.to_thread(state.checked_prompts, prompts, params, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await state.submit(ids, params, request_id, "prompt")
        fmt = CompletionFormat(body, state.engine.tokenizer)           # echo and log-probs
        if body.stream:
            builder = _completion_chunks(request_id, state.served_model_name, fmt, params.n)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return SSEResponse(stream_sse(streams, builder, include_usage))
        finals = [fmt.view(o) for o in await _collect(request, streams)]
        choices = [fmt.choice(i, o) for i, o in enumerate(finals)]
        return CompletionResponse(id=request_id, model=state.served_model_name, choices=choices,
                                  usage=usage(finals, params.n), dspark=spec_info([o.spec for o in finals]))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        check_chat(body, state.limits)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        params = sampling_params(body, max_tokens if max_tokens is not None else state.engine.max_model_len,
                                 param, state.sampling_defaults)
        prompt = await asyncio.to_thread(chat_prompt, body, state.engine.tokenizer)
        ids = await asyncio.to_thread(state.checked_prompts, [prompt], params, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await state.submit(ids, params, request_id, "messages")
        fmt = ChatFormat(body, state.engine.tokenizer)                 # log-probs
        if body.stream:
            builder = _chat_chunks(request_id, state.served_model_name, fmt, params.n)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return SSEResponse(stream_sse(streams, builder, include_usage))
        finals = await _collect(request, streams)
        choices = [ChatChoice(index=i, message=AssistantMessage(content=o.text), logprobs=fmt.whole(o),
                              finish_reason=o.finish_reason, stop_reason=o.stop_reason)
                   for i, o in enumerate(finals)]
        return ChatCompletionResponse(id=request_id, model=state.served_model_name, choices=choices,
                                      usage=usage(finals, params.n), dspark=spec_info([o.spec for o in finals]))


async def _collect(request: Request, streams: list[RequestStream]):
    try:
        return await unless_disconnected(request, collect(streams))
    except ClientGone:
        logger.info("client left before its answer was ready; aborted %d request(s)", len(streams))
        raise


async def _client_gone(request: Request, exc: ClientGone) -> Response:
    return Response(status_code=499)       # nobody reads it; the nginx convention for the log


def _completion_chunks(request_id: str, model: str, fmt: CompletionFormat, n: int) -> ChunkBuilder:
    created = int(time.time())

    def make(index: int, text: str, output, first: bool) -> CompletionChunk:
        choice = fmt.chunk_choice(index, text, output, first)
        return CompletionChunk(id=request_id, created=created, model=model, choices=[choice],
                               dspark=spec_info([output.spec]) if output.finished else None)

    def make_usage(finals) -> CompletionChunk:
        return CompletionChunk(id=request_id, created=created, model=model, choices=[],
                               usage=usage(finals, n), dspark=spec_info([o.spec for o in finals]))

    return ChunkBuilder(make, make_usage, announce=fmt.echo, view=fmt.view)


def _chat_chunks(request_id: str, model: str, fmt: ChatFormat, n: int) -> ChunkBuilder:
    created = int(time.time())

    def make(index: int, text: str, output, first: bool) -> ChatCompletionChunk:
        final = output if output.finished else None
        delta = DeltaMessage(role="assistant" if first else None, content=text if text or first else None)
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=fmt.delta(output),
                                 finish_reason=final and final.finish_reason)
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice],
                                   dspark=spec_info([final.spec]) if final else None)

    def make_usage(finals) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                   usage=usage(finals, n), dspark=spec_info([o.spec for o in finals]))

    return ChunkBuilder(make, make_usage, announce=True)
