"""Request and response bodies of the OpenAI-compatible API (the OpenAPI document is built from these).

Requests ignore fields they do not know, like OpenAI's API; fields we know but do not implement
(tools, penalties, logit bias, ...) are accepted only at their neutral value and otherwise
rejected with a 400 naming the field (see ``api/params.py``), never silently dropped.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
MAX_CHOICES = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1000
MAX_TOP_LOGPROBS = 20


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="null", allow_inf_nan=False)


class StreamOptions(RequestModel):
    include_usage: bool = False


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(RequestModel):
    url: str


class VideoPart(RequestModel):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


StopStrings = (
    str | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]], Field(max_length=MAX_STOP_STRINGS)]
)


class SamplingRequest(RequestModel):
    """Fields shared by chat and text completions (OpenAI's, then vLLM-style extras)."""

    model: str
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: StopStrings | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="only 0 is supported")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="only 0 is supported")
    logit_bias: dict[str, float] | None = Field(None, description="not supported")
    user: str | None = None
    # Extras, as vLLM names them.
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**31), le=INT32_MAX, description="lower runs first among waiting requests")
    cache_salt: str | None = Field(None, max_length=256, description="requests with different salts never share KV")
    return_tokens_as_token_ids: bool = Field(False, description="logprobs name tokens 'token_id:N'")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, description="not supported")
    tool_choice: str | dict[str, Any] | None = Field(None, description="only 'none' is supported")
    response_format: dict[str, Any] | None = Field(None, description="only {'type': 'text'} is supported")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0, le=UINT32_MAX)]], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[Annotated[int, Field(ge=0, le=UINT32_MAX)]], Field(min_length=1)]], Field(min_length=1)
        ]
    )
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="only best_of == n is supported")
    suffix: str | None = Field(None, description="not supported")


# ------------------------------------------------------------------------------------------------
# Responses (the streaming chunks are rendered by hand in api/render.py in the same shapes).


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "m3stack"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
