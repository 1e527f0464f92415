"""OpenAI requests -> engine requests, and engine outputs -> OpenAI responses and SSE chunks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dspark.outputs import RequestOutput, SpecStats
from dspark.sampling_params import ParamError, SamplingParams
from dspark.server.async_engine import EngineNotRunning, RequestFailed, RequestStream, ServerShuttingDown
from dspark.server.errors import APIError
from dspark.server.limits import LimitExceeded, ServerLimits
from dspark.server.logprobs import logprob_params, prompt_only
from dspark.server.request_stream import ReaderTooSlow
from dspark.server.protocol import (ChatCompletionRequest, CompletionRequest, SamplingFields,
                                    SpecStatsInfo, Usage)
from dspark.server.unsupported import CHAT, COMPLETION, MESSAGE, SHARED, log_unknown, refuse_unsupported
from dspark.tokenizer import Tokenizer

SHUTTING_DOWN = "server_shutting_down"    # the error code of everything a draining server refuses


# ---- requests ---------------------------------------------------------------------------------

def _check_common(req: SamplingFields, table: dict, where: str, limits: ServerLimits) -> None:
    refuse_unsupported(req, SHARED)
    refuse_unsupported(req, table)
    log_unknown(req, where)
    _within(limits.check_choices, 1, req.n or 1)
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != (req.n or 1):
        raise APIError(400, f"'best_of' must equal n ({req.n or 1}), got {best_of}: returning the best n "
                       "of more samples is not supported (vLLM's V1 engine dropped it too)",
                       param="best_of", code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true",
                       param="stream_options")
    _within(limits.check_stop, _stops(req), list(req.stop_token_ids or []))


def check_completion(req: CompletionRequest, limits: ServerLimits) -> None:
    _check_common(req, COMPLETION, "/v1/completions", limits)


def check_chat(req: ChatCompletionRequest, limits: ServerLimits) -> None:
    _check_common(req, CHAT, "/v1/chat/completions", limits)
    for i, message in enumerate(req.messages):
        refuse_unsupported(message, MESSAGE, prefix=f"messages.{i}.")
        log_unknown(message, "a chat message")


def _within(check: Callable, *args) -> None:
    try:
        check(*args)
    except LimitExceeded as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from exc


def _stops(req: SamplingFields) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def sampling_params(req: SamplingFields, max_tokens: int | None, max_tokens_param: str,
                    defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """Unset (or null) OpenAI fields take the model's recommended `defaults` (generation_config.py)
    and else SamplingParams' own; a bad value is a 400 naming the field."""
    kwargs: dict = dict(defaults or {}, seed=req.seed, stop=_stops(req),
                        stop_token_ids=list(req.stop_token_ids or []))
    for name in ("temperature", "top_p", "top_k", "min_p", "ignore_eos", "skip_special_tokens",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
                 "include_stop_str_in_output", "n"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.logit_bias:
        kwargs["logit_bias"] = _logit_bias(req.logit_bias)
    kwargs.update(logprob_params(req))
    if max_tokens is not None:        # echo with max_tokens 0: one token, dropped (logprobs.py)
        kwargs["max_tokens"] = 1 if prompt_only(req, max_tokens) else max_tokens
    try:
        return SamplingParams(**kwargs)
    except ParamError as exc:
        message, param = str(exc), exc.param
        if param == "max_tokens":
            param = max_tokens_param
            message = message.replace("max_tokens", max_tokens_param, 1)
        raise APIError(400, message, param=param, code="invalid_value") from exc


def _logit_bias(bias: dict[str, Any]) -> dict[int, Any]:
    """OpenAI sends token ids as JSON object keys, so as strings: each must spell a token id (the
    values are checked by SamplingParams)."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias keys must be token ids (decimal integers), got {key[:32]!r}",
                           param="logit_bias", code="invalid_value")
        out[int(key)] = value
    return out


def completion_prompts(req: CompletionRequest, limits: ServerLimits) -> list[str | list[int]]:
    """A string, token ids, or a batch of either: one engine request (and n choices) per prompt."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
    _within(limits.check_prompts, len(prompts))
    _within(limits.check_choices, len(prompts), req.n or 1)
    return prompts


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer | None) -> list[int]:
    """The chat-templated prompt's token ids (run off the event loop: templating and tokenizing
    a long conversation takes milliseconds)."""
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions "
                       "with token ids", param="messages")
    messages = [m.as_template_input() for m in req.messages]
    add_generation_prompt = req.add_generation_prompt is not False
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages", code="chat_template_error") from exc
    return tokenizer.encode(text, add_special_tokens=False)


def checked_prompt(check: Callable, prompt: str | list[int], params: SamplingParams,
                   param: str) -> list[int]:
    """The prompt's token ids as the engine would take them (`Engine.check_request`), or a 400
    naming what is wrong: tokenized here, off the engine thread and before admission."""
    try:
        return check(prompt, params)[1]
    except (ValueError, TypeError) as exc:
        raise refusal(exc, param) from exc


def refusal(exc: ValueError | TypeError, prompt_param: str) -> APIError:
    """The 400 for a request the engine refuses: a sampling parameter names itself, anything
    else is the prompt's (`prompt_param`)."""
    if isinstance(exc, ParamError):
        return APIError(400, str(exc), param=exc.param, code="invalid_value")
    return APIError(400, str(exc), param=prompt_param, code="invalid_prompt")


# ---- outputs ----------------------------------------------------------------------------------

def spec_info(stats: list[SpecStats]) -> SpecStatsInfo:
    total = SpecStats.total(stats)
    return SpecStatsInfo(draft_rounds=total.draft_rounds, drafted_tokens=total.drafted_tokens,
                         verified_tokens=total.verified_tokens, accepted_tokens=total.accepted_tokens,
                         accepted_per_position=total.accepted_per_position,
                         acceptance_rate=round(total.acceptance_rate, 6),
                         mean_accepted_length=round(total.mean_accepted_length, 6),
                         undrafted_steps=total.undrafted_steps)


def usage(outputs: list[RequestOutput], n: int = 1) -> Usage:
    """Token counts of a response's choices, in order, `n` per prompt: each prompt counted once."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs[::n])
    completion = sum(len(o.token_ids) for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


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
    except ServerShuttingDown as exc:         # ended by the shutdown's grace period
        raise APIError(503, str(exc), code=SHUTTING_DOWN) from exc
    except EngineNotRunning as exc:           # the engine is gone (a data-parallel rank failed)
        raise APIError(503, str(exc), code="engine_unavailable") from exc
    return [finals[i] for i in range(len(streams))]


@dataclass
class ChunkBuilder:
    """Builds one SSE payload (a pydantic chunk) per choice update; set by each endpoint.
    `make(index, new text, output, first)`; `announce`: a choice's first output is sent even
    without text (chat: the role arrives with the first token, not before prefill; an echo: the
    prompt); `view`: what the client sees of each output (logprobs.CompletionFormat.view)."""
    make: Callable[[int, str, RequestOutput, bool], object]
    make_usage: Callable[[list[RequestOutput]], object]
    announce: bool = False
    view: Callable[[RequestOutput], RequestOutput] | None = None


def sse(payload: object) -> str:
    return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"   # type: ignore[attr-defined]


def sse_error(message: str, status: int = 500, code: str = "engine_error") -> str:
    body = APIError(status, message, code=code).body()
    return f"data: {json.dumps(body)}\n\n"


async def stream_sse(streams: list[RequestStream], builder: ChunkBuilder,
                     include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: deltas per choice, an optional usage chunk, then `data: [DONE]`. The engine
    holds back text that may still become a stop string, so each delta is final."""
    finals: dict[int, RequestOutput] = {}
    started: set[int] = set()
    try:
        async for index, output in merge_streams(streams):
            output = builder.view(output) if builder.view is not None else output
            first = index not in started
            if output.finished or output.new_text or (first and builder.announce):
                started.add(index)
                yield sse(builder.make(index, output.new_text, output, first))
            if output.finished:
                finals[index] = output
        if include_usage:
            yield sse(builder.make_usage([finals[i] for i in sorted(finals)]))
    except RequestFailed as exc:
        yield sse_error(str(exc))
    except ReaderTooSlow as exc:              # only seen by a reader that came back
        yield sse_error(str(exc), exc.status, exc.code)
    except ServerShuttingDown as exc:
        yield sse_error(str(exc), 503, SHUTTING_DOWN)
    except EngineNotRunning as exc:
        yield sse_error(str(exc), 503, "engine_unavailable")
    yield "data: [DONE]\n\n"
