"""OpenAI-shaped request and response bodies (pydantic, the HTTP boundary only).

Numbers and token ids are strict (no bools, no numeric strings) so a wrong type is reported as
such instead of being silently coerced.  Unknown fields are ignored, as clients send many
optional OpenAI parameters that do not change what a local model does; parameters that *would*
change the answer and are not supported (n > 1, logprobs, echo, penalties, ...) are rejected in
`serving.py` with a 400 that names them.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

Number = Annotated[float, Field(strict=True)]
TokenIds = list[StrictInt]
Prompt = Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]
Stop = Union[StrictStr, list[StrictStr], None]

# What a union field expects, for error messages (pydantic reports every union member).
FIELD_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a list of {role, content} objects",
    "content": "a string or a list of text parts",
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: StrictBool = False


class SamplingFields(_Request):
    """Fields shared by both endpoints; the extensions (top_k, min_p, ...) follow vLLM's names."""
    model: StrictStr | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: Stop = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Request):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def as_template_input(self) -> dict[str, Any]:
        """Chat templates expect plain string content; text parts are joined in order."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True


class TokenizeRequest(_Request):
    model: StrictStr | None = None
    prompt: StrictStr


# ---- responses ----------------------------------------------------------------------------------

def _now() -> int:
    return int(time.time())


class SpecStatsInfo(BaseModel):
    """Speculative decoding counters of one request (or the sum over a response's choices)."""
    draft_rounds: int = 0
    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = Field(default_factory=list)
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    undrafted_steps: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    dspark: SpecStatsInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    dspark: SpecStatsInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    dspark: SpecStatsInfo | None = None


class CompletionChunk(BaseModel):
    """Streamed completions reuse the `text_completion` object, as OpenAI does."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    dspark: SpecStatsInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "dspark"
    max_model_len: int
    speculative: bool
    gamma: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
