"""``/tokenize`` and ``/detokenize`` in vLLM's shapes: a text prompt or a chat (rendered as a completion request
would render it, tools and thinking mode included) to token ids, and ids back to text."""

from typing import Annotated, Any

from pydantic import BaseModel, Field

from m3stack.gateway.schemas import ChatMessage, ChatTool, RequestModel, TokenId


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = Field(False, description="the chat template writes the special tokens itself")
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


TokenizeRequest = Annotated[TokenizeCompletionRequest | TokenizeChatRequest, Field(union_mode="left_to_right")]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
