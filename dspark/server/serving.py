"""OpenAI requests -> engine requests, and engine outputs -> OpenAI responses and SSE chunks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from dspark.outputs import RequestOutput, SpecStats
from dspark.sampling_params import SamplingParams
from dspark.server.async_engine import EngineNotRunning, RequestFailed, RequestStream
from dspark.server.errors import APIError
from dspark.server.protocol import (ChatCompletionRequest, CompletionRequest, SamplingFields,
                                    SpecStatsInfo, Usage)
from dspark.tokenizer import Tokenizer

_PARAM_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop_token_ids", "stop")


# ---- requests ---------------------------------------------------------------------------------

def _reject(param: str, what: str) -> None:
    raise APIError(400, f"'{param}' is not supported by this server: {what}", param=param,
                   code="unsupported_parameter")


def _check_shared(req: SamplingFields) -> None:
    if req.n != 1:
        _reject("n", "only n=1 is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            _reject(name, "penalties are not implemented")
    if req.logit_bias:
        _reject("logit_bias", "logit biases are not implemented")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true",
                       param="stream_options")


def check_completion(req: CompletionRequest) -> None:
    _check_shared(req)
    if req.echo:
        _reject("echo", "echoing the prompt is not implemented")
    if req.logprobs is not None:
        _reject("logprobs", "log probabilities are not implemented")
    if req.best_of not in (None, 1):
        _reject("best_of", "only best_of=1 is supported")
    if req.suffix:
        _reject("suffix", "insertion (suffix) is not implemented")


def check_chat(req: ChatCompletionRequest) -> None:
    _check_shared(req)
    if req.logprobs or req.top_logprobs:
        _reject("logprobs", "log probabilities are not implemented")
    if req.tools:
        _reject("tools", "tool calling is not implemented")
    if req.response_format and req.response_format.get("type", "text") != "text":
        _reject("response_format", "only plain text responses are implemented")


def sampling_params(req: SamplingFields, max_tokens: int | None, max_tokens_param: str) -> SamplingParams:
    """Unset OpenAI fields keep SamplingParams' defaults; a bad value is a 400 naming the field."""
    kwargs: dict = dict(seed=req.seed, ignore_eos=req.ignore_eos,
                        skip_special_tokens=req.skip_special_tokens,
                        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                        stop_token_ids=list(req.stop_token_ids or []))
    for name in ("temperature", "top_p", "top_k", "min_p"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
        param = next((f for f in _PARAM_FIELDS if message.startswith(f)), None)
        if param == "max_tokens":
            param = max_tokens_param
            message = message.replace("max_tokens", max_tokens_param, 1)
        raise APIError(400, message, param=param, code="invalid_value") from exc


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """A string, token ids, or a batch of either: one engine request (and choice) per prompt."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
    return prompts


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer | None) -> list[int]:
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions "
                       "with token ids", param="messages")
    messages = [m.as_template_input() for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages", code="chat_template_error") from exc
    return tokenizer.encode(text, add_special_tokens=False)


# ---- outputs ----------------------------------------------------------------------------------

def spec_info(stats: list[SpecStats]) -> SpecStatsInfo:
    total = SpecStats.total(stats)
    return SpecStatsInfo(draft_rounds=total.draft_rounds, drafted_tokens=total.drafted_tokens,
                         verified_tokens=total.verified_tokens, accepted_tokens=total.accepted_tokens,
                         accepted_per_position=total.accepted_per_position,
                         acceptance_rate=round(total.acceptance_rate, 6),
                         mean_accepted_length=round(total.mean_accepted_length, 6),
                         undrafted_steps=total.undrafted_steps)


def usage(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.token_ids) for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class StopHoldback:
    """Streams text that no later stop-string match can take back.

    The engine truncates a request's text where a stop string starts, and that start may lie in
    text an earlier step already produced.  Holding back the longest tail that could still begin
    a stop string makes the streamed text equal the final text.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.sent = 0

    def delta(self, output: RequestOutput) -> str:
        text = output.text
        end = len(text) if output.finished else self._safe_end(text)
        if end <= self.sent:
            return ""
        chunk, self.sent = text[self.sent:end], end
        return chunk

    def _safe_end(self, text: str) -> int:
        end = len(text)
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    end = min(end, len(text) - size)
                    break
        return end


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several requests as they come; closing aborts them all."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in merge_streams(streams):
            if output.finished:
                finals[index] = output
    except RequestFailed as exc:
        raise APIError(500, str(exc), code="engine_error") from exc
    except EngineNotRunning as exc:           # the engine is gone (a data-parallel rank failed)
        raise APIError(503, str(exc), code="engine_unavailable") from exc
    return [finals[i] for i in range(len(streams))]


@dataclass
class ChunkBuilder:
    """Builds one SSE payload (a pydantic chunk) per choice update; set by each endpoint."""
    make: Callable[[int, str, RequestOutput | None], object]
    make_usage: Callable[[list[RequestOutput]], object]
    first: Callable[[int], object] | None = None     # the chat "role" chunk


def sse(payload: object) -> str:
    return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"   # type: ignore[attr-defined]


def sse_error(message: str, status: int = 500, code: str = "engine_error") -> str:
    body = APIError(status, message, code=code).body()
    return f"data: {json.dumps(body)}\n\n"


async def stream_sse(streams: list[RequestStream], stops: list[str], builder: ChunkBuilder,
                     include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: deltas per choice, an optional usage chunk, then `data: [DONE]`."""
    holdbacks = [StopHoldback(stops) for _ in streams]
    finals: dict[int, RequestOutput] = {}
    if builder.first is not None:
        for index in range(len(streams)):
            yield sse(builder.first(index))
    try:
        async for index, output in merge_streams(streams):
            text = holdbacks[index].delta(output)
            if output.finished:
                finals[index] = output
                yield sse(builder.make(index, text, output))
            elif text:
                yield sse(builder.make(index, text, None))
        if include_usage:
            yield sse(builder.make_usage([finals[i] for i in sorted(finals)]))
    except RequestFailed as exc:
        yield sse_error(str(exc))
    except EngineNotRunning as exc:
        yield sse_error(str(exc), 503, "engine_unavailable")
    yield "data: [DONE]\n\n"
