"""Requests to prompt token ids: chat template + tokenizer for chats, the tokenizer (or the ids as
given) for completions.  The CPU work runs in a thread pool, off the event loop."""

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from m3stack.gateway.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, TextPart
from m3stack.gateway.errors import invalid_request, not_supported
from m3stack.gateway.tokenize.chat_template import ChatTemplate, ChatTemplateError
from m3stack.gateway.tokenize.tokenizer import ModelTokenizer

T = TypeVar("T")


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # what ``echo`` returns: the prompt as text


class PromptBuilder:
    def __init__(self, tokenizer: ModelTokenizer, template: ChatTemplate | None, executor: Executor) -> None:
        self._tokenizer = tokenizer
        self._template = template
        self._executor = executor

    async def _off_loop(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def chat(self, request: ChatCompletionRequest) -> Prompt:
        if self._template is None:
            raise invalid_request(
                "The model has no chat template (chat_template.jinja or tokenizer_config.json); use /v1/completions",
                param="messages",
            )
        if any(_has_media(message) for message in request.messages):
            # The hook for gateway/multimodal: fetch and preprocess the parts, then expand each placeholder
            # of the token ids into the item's tokens and send the items with the request.
            raise not_supported("image_url and video_url content (multimodal input is not wired in yet)", "messages")
        messages = [_template_message(message) for message in request.messages]
        template = self._template

        def render_and_encode() -> Prompt:
            try:
                text = template.render(
                    messages,
                    add_generation_prompt=request.add_generation_prompt,
                    extra_variables=request.chat_template_kwargs,
                )
            except ChatTemplateError as exc:
                raise invalid_request(str(exc), param="messages") from exc
            # The template writes the special tokens itself (BOS included).
            return Prompt(self._encode(text, add_special_tokens=False, param="messages"), text)

        return await self._off_loop(render_and_encode)

    async def completion(self, request: CompletionRequest) -> list[Prompt]:
        prompt = request.prompt
        if isinstance(prompt, str):
            texts: list[str] | None = [prompt]
        elif isinstance(prompt[0], str):
            texts = list(prompt)  # type: ignore[arg-type]
        else:
            texts = None
        if texts is not None:
            return await self._off_loop(
                lambda: [Prompt(self._encode(text, add_special_tokens=True, param="prompt"), text) for text in texts]
            )
        id_lists: Sequence[list[int]] = [prompt] if isinstance(prompt[0], int) else prompt  # type: ignore[list-item,assignment]
        vocab = self._tokenizer.vocab_size
        for ids in id_lists:
            if (bad := next((i for i in ids if i >= vocab), None)) is not None:
                raise invalid_request(f"token id {bad} is outside the vocabulary (size {vocab})", param="prompt")
        return await self._off_loop(
            lambda: [Prompt(list(ids), self._tokenizer.decode(ids, skip_special_tokens=False)) for ids in id_lists]
        )

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:  # e.g. a lone surrogate ("\ud800" in the JSON): TypeError from the Rust side
            raise invalid_request(f"the text cannot be tokenized (invalid Unicode?): {exc}", param=param) from exc
        if not ids:
            raise invalid_request("the prompt is empty", param=param)
        return ids


def _has_media(message: ChatMessage) -> bool:
    return isinstance(message.content, list) and any(not isinstance(part, TextPart) for part in message.content)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: a plain dict; text parts are concatenated into one string,
    which every template accepts and which is what M3's template renders for a list of text parts."""
    rendered = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        rendered["content"] = "".join(part.text for part in message.content if isinstance(part, TextPart))
    return rendered
