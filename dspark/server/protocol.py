"""OpenAI-shaped request and response bodies (pydantic, the HTTP boundary only).

Numbers and token ids are strict (no bools, no numeric strings) so a wrong type is reported as
such instead of being silently coerced; `null` is accepted wherever the OpenAI API accepts it and
means the default. Fields that would change the answer but are not implemented are declared here
(so the schema shows them) and refused in `unsupported.py` unless set to their neutral value;
undeclared fields are kept (`model_extra`) only to be logged once.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt


def _unicode(value: str) -> str:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800") and Python decodes it into a string no
    tokenizer or response can encode: refused at the boundary, not failed on later."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone UTF-16 surrogate at character {exc.start}, which is not "
                         "valid Unicode") from None
    return value


Text = Annotated[str, Field(strict=True), AfterValidator(_unicode)]     # every string field

Number = Annotated[float, Field(strict=True)]
TokenIds = list[StrictInt]
Prompt = Union[Text, list[Text], TokenIds, list[TokenIds]]
Stop = Union[Text, list[Text], None]

# What a union field expects, for error messages (pydantic reports every union member).
FIELD_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a list of {role, content} objects",
    "content": "a string or a list of text parts",
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: StrictBool = False


class SamplingFields(_Request):
    """Fields shared by both endpoints; the extensions (top_k, min_p, ...) follow vLLM's names."""
    model: Text | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: Stop = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: Text | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None         # token id (a string, as JSON keys are) -> bias
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    include_stop_str_in_output: StrictBool | None = None
    n: StrictInt | None = None                       # choices per prompt (parallel sampling)
    # not implemented: refused unless neutral (unsupported.py)
    length_penalty: Number | None = None
    use_beam_search: StrictBool | None = None
    bad_words: list[Text] | None = None
    allowed_token_ids: TokenIds | None = None
    truncate_prompt_tokens: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None
    spaces_between_special_tokens: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: StrictInt | None = 16                # 0 with echo: the prompt (and its log-probs) only
    echo: StrictBool | None = None
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None                 # only equal to n (serving.py)
    suffix: Text | None = None
    add_special_tokens: StrictBool | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Text
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[Any] | None = None              # refused (unsupported.py)
    tool_call_id: Text | None = None            # refused

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
    add_generation_prompt: StrictBool | None = None
    parallel_tool_calls: StrictBool | None = None    # no effect without tools
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None            # needs logprobs: true
    # not implemented: refused unless neutral (unsupported.py)
    echo: StrictBool | None = None
    tools: list[Any] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Text | dict[str, Any] | None = None
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: StrictBool | None = None
    documents: list[Any] | None = None
    add_special_tokens: StrictBool | None = None
    modalities: list[Text] | None = None
    audio: dict[str, Any] | None = None
    reasoning_effort: Text | None = None


class TokenizeRequest(_Request):
    """vLLM's two forms: a `prompt`, or chat `messages` rendered through the chat template."""
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool | None = None      # chat form; default true
    add_special_tokens: StrictBool | None = None         # default: true for a prompt, false for chat


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: TokenIds


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


class CompletionLogprobs(BaseModel):
    """The legacy completions shape, one entry per token (the first prompt token's are null)."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
