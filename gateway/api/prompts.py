"""Requests to prompt token ids: chat template + tokenizer for chats, the tokenizer (or the ids as
given) for completions.  Tokenizing runs in a thread pool, off the event loop.

Image and video parts go through ``gateway/multimodal``'s pipeline the way the reference processor
does it: the template writes one marker per part, the pipeline fetches and preprocesses the media,
expands each marker into the item's placeholder tokens, and the spans of those tokens travel with the
items to the engine.
"""

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from m3stack.gateway.agentic.tools import template_tool_calls
from m3stack.gateway.api.params import max_new_tokens
from m3stack.gateway.api.request_limits import check_prompt_length
from m3stack.gateway.errors import APIError, invalid_request, not_supported
from m3stack.gateway.multimodal import MediaError, MediaPart, MediaPipeline, PlacedItem
from m3stack.gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImagePart,
    TextPart,
    VideoPart,
)
from m3stack.gateway.tokenize.chat_template import ChatTemplate, ChatTemplateError
from m3stack.gateway.tokenize.tokenizer import ModelTokenizer

T = TypeVar("T")

# Texts up to this size are tokenized on the event loop: that takes well under a millisecond, less than
# the hop to a worker thread, which under load also waits for the GIL (up to the 5 ms switch interval,
# twice).  Longer texts go to the thread pool, where the Rust tokenizer runs without the GIL.
INLINE_TOKENIZE_MAX_CHARS = 1024


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # what ``echo`` returns: the prompt as text
    mm_items: tuple[PlacedItem, ...] = ()


class PromptBuilder:
    def __init__(
        self,
        tokenizer: ModelTokenizer,
        template: ChatTemplate | None,
        executor: Executor,
        media: MediaPipeline | None,
    ) -> None:
        self._tokenizer = tokenizer
        self._template = template
        self._executor = executor
        self._media = media

    async def _tokenize(self, work: Callable[[], T], chars: int) -> T:
        if chars <= INLINE_TOKENIZE_MAX_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def chat(
        self,
        request: ChatCompletionRequest,
        context_length: int,
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> Prompt:
        """``tools`` and ``variables`` (extra template variables, else the request's chat_template_kwargs) go to the
        chat template."""
        if self._template is None:
            raise invalid_request(
                "The model has no chat template (chat_template.jinja or tokenizer_config.json); use /v1/completions",
                param="messages",
            )
        media_parts = _media_parts(request.messages)
        if media_parts and self._media is None:
            raise not_supported("image_url and video_url content (this gateway runs without media support)", "messages")
        messages = [_template_message(message, index) for index, message in enumerate(request.messages)]
        check_prompt_length(
            _conversation_chars(messages), context_length, self._tokenizer.max_chars_per_token, "messages"
        )
        template = self._template

        def render_and_encode() -> Prompt:
            try:
                text = template.render(
                    messages,
                    add_generation_prompt=request.add_generation_prompt,
                    tools=tools,
                    extra_variables=variables if variables is not None else request.chat_template_kwargs,
                )
            except ChatTemplateError as exc:
                raise invalid_request(str(exc), param="messages") from exc
            # The template writes the special tokens itself (BOS included).
            return Prompt(self._encode(text, add_special_tokens=False, param="messages"), text)

        prompt = await self._tokenize(render_and_encode, _conversation_chars(messages))
        if not media_parts:
            return prompt
        return await self._with_media(prompt, media_parts, context_length)

    async def _with_media(self, prompt: Prompt, parts: list[MediaPart], context_length: int) -> Prompt:
        media = self._media
        assert media is not None and prompt.text is not None
        try:
            # Each marker of the templated text becomes the item's tokens: the rest of the context is theirs.
            items = await media.process_media(parts, vision_token_budget=context_length - len(prompt.token_ids))
            expanded = media.expand_prompt(prompt.text, items)
            token_ids = await self._tokenize(
                lambda: self._encode(expanded, add_special_tokens=False, param="messages"), len(expanded)
            )
            spans = media.placeholder_spans(token_ids, self._tokenizer, items)
        except MediaError as exc:
            raise APIError(exc.status, exc.message, param=exc.param, code=exc.code) from exc
        return Prompt(token_ids, prompt.text, media.place(items, spans))

    async def text_ids(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """One text's token ids (``/tokenize``)."""
        return await self._tokenize(lambda: self._encode(text, add_special_tokens, param), len(text))

    async def completion(self, request: CompletionRequest, context_length: int) -> list[Prompt]:
        prompt = request.prompt
        if isinstance(prompt, str):
            texts: list[str] | None = [prompt]
        elif isinstance(prompt[0], str):
            texts = list(prompt)  # type: ignore[arg-type]
        else:
            texts = None
        if texts is not None:
            for text in texts:
                check_prompt_length(len(text), context_length, self._tokenizer.max_chars_per_token, "prompt")
            return await self._tokenize(
                lambda: [Prompt(self._encode(text, add_special_tokens=True, param="prompt"), text) for text in texts],
                sum(map(len, texts)),
            )
        id_lists: Sequence[list[int]] = [prompt] if isinstance(prompt[0], int) else prompt  # type: ignore[list-item,assignment]
        vocab = self._tokenizer.vocab_size
        for ids in id_lists:
            # Over the context: refused by its exact length before the per-id checks below walk it.
            max_new_tokens(None, "max_tokens", len(ids), context_length, "prompt")
            if (bad := next((i for i in ids if i >= vocab), None)) is not None:
                raise invalid_request(f"token id {bad} is outside the vocabulary (size {vocab})", param="prompt")
        if not request.echo:
            return [Prompt(list(ids), None) for ids in id_lists]
        return await self._tokenize(
            lambda: [Prompt(list(ids), self._tokenizer.decode(ids, skip_special_tokens=False)) for ids in id_lists],
            sum(map(len, id_lists)),
        )

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:  # e.g. a lone surrogate ("\ud800" in the JSON): TypeError from the Rust side
            raise invalid_request(_untokenizable(text, param), param=param) from exc
        if not ids:
            raise invalid_request("the prompt is empty", param=param)
        return ids


def _untokenizable(text: str, param: str) -> str:
    """Why ``text`` cannot be tokenized, in the client's terms (the tokenizer's own error names its Rust types)."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        # JSON may escape half of a UTF-16 surrogate pair on its own ("\ud800"): no character, so no UTF-8 either.
        code = ord(text[exc.start])
        return f"{param} holds a lone surrogate (\\u{code:04x}), which is not a Unicode character"
    return f"{param} cannot be tokenized"


def _conversation_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(v) for m in messages for v in (m.get("content"), m.get("reasoning_content")) if isinstance(v, str))


def _media_parts(messages: list[ChatMessage]) -> list[MediaPart]:
    parts = []
    for m, message in enumerate(messages):
        for p, part in enumerate(message.content if isinstance(message.content, list) else ()):
            param = f"messages[{m}].content[{p}]"
            if isinstance(part, ImagePart):
                parts.append(MediaPart("image", part.image_url.url, param))
            elif isinstance(part, VideoPart):
                parts.append(MediaPart("video", part.video_url.url, param))
    return parts


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates expect it: a plain dict.  Text-only content becomes one string
    (which every template accepts, and what M3's template renders for a list of text parts); content
    with media stays a list, images and videos as ``{"type": "image"}`` / ``{"type": "video"}`` parts,
    as the reference processor passes them."""
    rendered = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        if all(isinstance(part, TextPart) for part in content):
            rendered["content"] = "".join(part.text for part in content if isinstance(part, TextPart))
        else:
            rendered["content"] = [
                {"type": "text", "text": part.text}
                if isinstance(part, TextPart)
                else {"type": "image" if isinstance(part, ImagePart) else "video"}
                for part in content
            ]
    if message.tool_calls:
        rendered["tool_calls"] = template_tool_calls(message.tool_calls, index)
    return rendered
