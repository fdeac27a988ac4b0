"""Request and response bodies of the OpenAI-compatible API (the OpenAPI document is built from these), below the
API that serves them and the agentic planners that read them.

Requests ignore fields they do not know, like OpenAI's API; fields we know but do not implement
(``suffix``, ...) are accepted only at their neutral value and otherwise rejected with a 400 naming
the field (see ``api/params.py``), never silently dropped.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler, TypeAdapter
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
MAX_CHOICES = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1000
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100
# The wire to the engines carries sampling settings as float32: a smaller positive value arrives as 0 (or as a
# subnormal), which the engine refuses where a setting must be positive.
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38


# A token id as the wire to the engines carries it.  The gateway checks ids against its vocabulary itself, and its
# OpenAPI document states that bound in place of this one (api/openapi_document.py).
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]


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


class FunctionCall(RequestModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text, as the model wrote them")


class ToolCall(RequestModel):
    id: str = Field(json_schema_extra={"minLength": 1})  # '' is refused by api/conversation.py, naming the call
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    """One message, of any role, as the chat route reads it.  What each role needs (content, tool calls and
    their answers) is checked by ``api/conversation.py``, which names the rule a message breaks in words
    (``messages[2].content: a tool message needs content``) where pydantic would say 'Field required' under
    a discriminator tag.  The OpenAPI document publishes the same rules as OpenAI's does: one object per
    role (``PublishedMessage``), so that a client generated from it writes messages the gateway takes."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return handler(_PUBLISHED_MESSAGE.core_schema)


# The message of each role as the OpenAPI document describes it (OpenAI's ChatCompletionRequest*Message):
# ``api/conversation.py`` enforces exactly these rules, and tests/gateway/api/test_conversation.py holds the two
# together.
TextContent = str | Annotated[list[TextPart], Field(min_length=1)]
UserContent = str | Annotated[list[ContentPart], Field(min_length=1)]


class _MessageFields(RequestModel):
    """The fields ``ChatMessage`` types for every role: a role that does not use one still has it typed (a number
    as ``name`` of a tool message is a 400), so the document names them all."""

    name: str | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=0)] | None = Field(
        None, description="only assistant messages make tool calls"
    )


class SystemMessage(_MessageFields):
    role: Literal["system"]
    content: TextContent


class DeveloperMessage(_MessageFields):
    role: Literal["developer"]
    content: TextContent


class UserMessage(_MessageFields):
    role: Literal["user"]
    content: UserContent = Field(description="images and videos go in user messages only")


class AssistantTurn(_MessageFields):
    """An earlier answer of the model: content, tool calls, or both."""

    model_config = ConfigDict(
        **RequestModel.model_config,
        json_schema_extra={
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}},
            ]
        },
    )

    role: Literal["assistant"]
    content: TextContent | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = Field(  # type: ignore[assignment]
        None, description="each answered by a tool message right after this one"
    )


class ToolMessage(_MessageFields):
    role: Literal["tool"]
    content: TextContent
    tool_call_id: str = Field(  # type: ignore[assignment]
        min_length=1, description="the id of a call of the assistant message this one follows (tool messages between)"
    )


PublishedMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantTurn | ToolMessage, Field(discriminator="role")
]
_PUBLISHED_MESSAGE: TypeAdapter[Any] = TypeAdapter(PublishedMessage)


TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
MAX_TOOLS = 256


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=TOOL_NAME_PATTERN, description="letters, digits, '_', '.', ':' and '-', at most 128")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments object")
    strict: bool | None = Field(None, description="calls are held to the schema when the call is forced either way")


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class TextResponseFormat(RequestModel):
    type: Literal["text"]


class JsonObjectResponseFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchemaSpec(RequestModel):
    model_config = ConfigDict(**RequestModel.model_config, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = Field(None, description="the output is held to the schema either way")


class JsonSchemaResponseFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextResponseFormat | JsonObjectResponseFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


# A string the document says is not empty, where the gateway's own check refuses '' with a message of its own
# (the stop strings in api/params.py, a prompt in api/prompts.py).
NonEmptyText = Annotated[str, Field(json_schema_extra={"minLength": 1})]
StopStrings = (
    NonEmptyText
    | Annotated[
        list[Annotated[NonEmptyText, Field(max_length=MAX_STOP_STRING_CHARS)]], Field(max_length=MAX_STOP_STRINGS)
    ]
)


# A logit_bias value as the document states it; api/params.py refuses the rest naming the entry.
LogitBias = Annotated[float, Field(json_schema_extra={"minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS})]


class SamplingRequest(RequestModel):
    """Fields shared by chat and text completions (OpenAI's, then vLLM-style extras)."""

    model: str
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=FLOAT32_MIN_NORMAL, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: StopStrings | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(
        0.0, ge=-2, le=2, description="subtracted from the logit of every token generated so far"
    )
    frequency_penalty: float = Field(
        0.0, ge=-2, le=2, description="times its count so far, subtracted from the logit of every generated token"
    )
    logit_bias: dict[str, LogitBias] | None = Field(
        None,
        description=f"token id (as a string) -> bias added to its logit, in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]",
        json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}},
    )
    user: str | None = None
    # Extras, as vLLM names them.
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    repetition_penalty: float | None = Field(
        None,
        ge=FLOAT32_MIN_NORMAL,
        le=2,
        description="transformers' and vLLM's, over prompt and output tokens; 1 = off",
    )
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
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
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="auto (the default with tools) lets the model choose; required and a named function force "
        "a call by constrained decoding",
    )
    parallel_tool_calls: bool = Field(True, description="whether a forced call may be several calls")
    response_format: ResponseFormat | None = Field(
        None, description="json_object and json_schema hold the output to JSON (of the schema) by constrained decoding"
    )
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="extra chat template variables; thinking_mode (adaptive, enabled, disabled) or "
        "enable_thinking (a boolean) switch M3's reasoning for this request",
    )


class CompletionRequest(SamplingRequest):
    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = Field(False, description="return the prompt before the completion; with logprobs, its logprobs too")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="only best_of == n is supported")
    suffix: str | None = Field(None, description="not supported: only null or ''", json_schema_extra={"maxLength": 0})


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
    reasoning_content: str | None = None
    # The same text under the name vLLM's server uses now (it keeps reasoning_content as a deprecated copy).
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
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
