"""The completions pipeline behind the routes: prompt -> engine requests -> streams -> response.

Route functions stay thin; this is where a request is checked against the model, dispatched,
and turned into an SSE stream or a JSON body.  Failures before the first token become HTTP errors;
after it (streaming), an ``error`` event ends the stream.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import replace
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from m3stack.gateway.agentic.chat_plan import ChatPlan, plan_chat
from m3stack.gateway.agentic.grammar import LarkWriter
from m3stack.gateway.agentic.m3_format import MARKER_TOKENS
from m3stack.gateway.api import params
from m3stack.gateway.api.access_log import CLIENT_CLOSED_REQUEST, access_record
from m3stack.gateway.api.conversation import check_conversation
from m3stack.gateway.api.prompts import Prompt, PromptBuilder
from m3stack.gateway.api.render import (
    SSE_DONE,
    ChoiceAccumulator,
    ChunkRenderer,
    ResponseMeta,
    chat_response,
    completion_response,
    error_event,
)
from m3stack.gateway.api.request_limits import RequestLimits
from m3stack.gateway.api.sse import EventStreamResponse
from m3stack.gateway.api.tokenize_api import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from m3stack.gateway.engine_client.pool import EnginePool
from m3stack.gateway.engine_client.requests import EngineRequest
from m3stack.gateway.errors import APIError, engine_failure, invalid_request, model_not_found, no_engine_available
from m3stack.gateway.generation.choice import ChoiceDecoder
from m3stack.gateway.generation.dispatch import Dispatcher, EngineStream, EngineStreamError
from m3stack.gateway.generation.run import ChoiceRun, Generation
from m3stack.gateway.metrics import GatewayMetrics
from m3stack.gateway.schemas import ChatCompletionRequest, CompletionRequest
from m3stack.gateway.tokenize.tokenizer import ModelTokenizer
from m3stack.logs import current_request_id
from m3stack.tracing import inject

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# /tokenize before any engine reported its context: no length check, media get any budget.
UNKNOWN_CONTEXT = 2**31 - 1
T = TypeVar("T")


class CompletionService:
    def __init__(
        self,
        served_model_name: str,
        tokenizer: ModelTokenizer,
        prompts: PromptBuilder,
        pool: EnginePool,
        dispatcher: Dispatcher,
        metrics: GatewayMetrics,
        limits: RequestLimits,
        thinking_mode: str = "adaptive",
    ) -> None:
        """``thinking_mode``: M3's reasoning for chat requests that do not choose (``--thinking-mode``)."""
        self.served_model_name = served_model_name
        self._tokenizer = tokenizer
        self._prompts = prompts
        self._pool = pool
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._limits = limits
        self._thinking_mode = thinking_mode
        self._lark = LarkWriter(tokenizer.special_token_ids)
        self._special_markers = frozenset(MARKER_TOKENS) & tokenizer.special_token_ids.keys()

    def check_model(self, model: str) -> None:
        if model != self.served_model_name:
            raise model_not_found(model, self.served_model_name)

    async def chat(self, request: ChatCompletionRequest, http_request: Request, arrival_s: float) -> Response:
        self.check_model(request.model)
        check_conversation(request.messages)
        params.reject_unsupported(request)
        plan = plan_chat(request, self._thinking_mode)
        context = self._context_length()
        self._limits.check_fan_out(1, request.n, self._pool.queue_capacity())
        variables = plan.template_variables(request.chat_template_kwargs)
        prompt = await self._prompts.chat(request, context, plan.template_tools(), variables)
        return await self._serve("chat", request, [prompt], context, http_request, arrival_s, plan)

    async def completions(self, request: CompletionRequest, http_request: Request, arrival_s: float) -> Response:
        self.check_model(request.model)
        params.reject_unsupported(request)
        context = self._context_length()
        self._limits.check_fan_out(num_prompts(request), request.n, self._pool.queue_capacity())
        prompts = await self._prompts.completion(request, context)
        return await self._serve("completion", request, prompts, context, http_request, arrival_s)

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """A prompt's token ids as a completion request would send them (a chat rendered with its tools and
        thinking mode, images and videos expanded)."""
        if request.model is not None:
            self.check_model(request.model)
        context = self._pool.context_length()
        if isinstance(request, TokenizeChatRequest):
            chat = ChatCompletionRequest(
                model=self.served_model_name,
                messages=request.messages,
                tools=request.tools,
                add_generation_prompt=request.add_generation_prompt,
                chat_template_kwargs=request.chat_template_kwargs,
            )
            check_conversation(chat.messages)
            plan = plan_chat(chat, self._thinking_mode)
            variables = plan.template_variables(chat.chat_template_kwargs)
            prompt = await self._prompts.chat(chat, context or UNKNOWN_CONTEXT, plan.template_tools(), variables)
            ids = prompt.token_ids
        else:
            ids = await self._prompts.text_ids(request.prompt, request.add_special_tokens, "prompt")
        strings = [self._tokenizer.id_to_token(token_id) for token_id in ids] if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=context, tokens=ids, token_strs=strings)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        if request.model is not None:
            self.check_model(request.model)
        vocab = self._tokenizer.vocab_size
        if (bad := next((i for i in request.tokens if i >= vocab), None)) is not None:
            raise invalid_request(f"token id {bad} is outside the vocabulary (size {vocab})", param="tokens")
        return DetokenizeResponse(prompt=self._tokenizer.decode(request.tokens, skip_special_tokens=False))

    def _context_length(self) -> int:
        context = self._pool.context_length()
        if context is None:
            raise no_engine_available(self._pool.seconds_until_retry(), "no engine is ready")
        return context

    # -------------------------------------------------------------------------------------------

    async def _serve(
        self,
        kind: str,
        request: ChatCompletionRequest | CompletionRequest,
        prompts: Sequence[Prompt],
        context: int,
        http_request: Request,
        arrival_s: float,
        plan: ChatPlan | None = None,
    ) -> Response:
        """``plan``: a chat request's tools, reasoning and output format (a grammar, an output parser)."""
        output = params.output_options(request)
        requested, max_param = params.requested_max_tokens(request)
        prompt_param = "messages" if kind == "chat" else "prompt"
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        metadata = request_metadata()
        batches = []
        for prompt_index, prompt in enumerate(prompts):
            max_new = params.max_new_tokens(requested, max_param, len(prompt.token_ids), context, prompt_param)
            sampling = params.sampling_params(request, max_new, output, self._tokenizer.vocab_size)
            if plan is not None and (grammar := plan.grammar(prompt.text or "", self._lark)) is not None:
                sampling = replace(sampling, grammar=grammar)
            first_choice = prompt_index * request.n
            batches.append(
                params.engine_requests(
                    request_id, prompt.token_ids, prompt.mm_items, sampling, request, first_choice, metadata
                )
            )
        streams = await _unless_client_leaves(self._open_all(prompts, batches), http_request)
        self._metrics.prompt_tokens.inc(sum(len(prompt.token_ids) for prompt in prompts))
        runs = [
            ChoiceRun(
                stream,
                self._decoder(prompt_index * request.n + i, prompt, output, plan),
                prompt_index,
            )
            for prompt_index, (prompt, prompt_streams) in enumerate(zip(prompts, streams, strict=True))
            for i, stream in enumerate(prompt_streams)
        ]
        generation = Generation(runs, self._metrics, arrival_s)
        if (access := access_record(http_request.scope)) is not None:
            access.model, access.stream, access.usage = self.served_model_name, bool(request.stream), generation.usage
        token_text = token_id_text if request.return_tokens_as_token_ids else self._tokenizer.token_text
        meta = ResponseMeta(request_id, self.served_model_name, int(time.time()), token_text, output.logprobs)
        echo = isinstance(request, CompletionRequest) and request.echo
        echo_texts = [prompt.text or "" for prompt in prompts for _ in range(request.n)] if echo else []
        echo_ids = [prompt.token_ids for prompt in prompts for _ in range(request.n)] if output.prompt_logprobs else []
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            renderer = ChunkRenderer(kind, meta, include_usage, len(runs), echo_texts, echo_ids)
            body = self._sse(generation, renderer, len(runs), include_usage, arrival_s)
            return EventStreamResponse(body, headers=SSE_HEADERS)
        choices = await self._collect(generation, len(runs), http_request)
        usage = generation.usage()
        if kind == "chat":
            payload: BaseModel = chat_response(meta, choices, usage)
        else:
            payload = completion_response(meta, choices, usage, echo_texts, echo_ids)
        self._metrics.e2e_latency.observe(time.perf_counter() - arrival_s)
        return JSONResponse(payload.model_dump(mode="json"))

    def _decoder(
        self, index: int, prompt: Prompt, output: params.OutputOptions, plan: ChatPlan | None
    ) -> ChoiceDecoder:
        hidden = self._special_markers if output.skip_special_tokens else frozenset()
        parser = plan.output_parser(prompt.text or "", hidden) if plan is not None else None
        # The parser reads M3's markers, which may be special tokens: decoding keeps them for it.
        tokenizer = self._tokenizer.keeping(parser.markers) if parser is not None else self._tokenizer
        return ChoiceDecoder(index, tokenizer, prompt.token_ids, output.stop_strings, output.skip_special_tokens,
                             self._tokenizer.eos_token_ids, parser)  # fmt: skip

    async def _open_all(
        self, prompts: Sequence[Prompt], batches: Sequence[Sequence[EngineRequest]]
    ) -> list[list[EngineStream]]:
        """Open every prompt's streams (each prompt is routed on its own); all or nothing."""
        if len(prompts) == 1:  # most requests: no gather, which would wrap the open in a task
            return [await self._dispatcher.open(prompts[0].token_ids, batches[0])]
        opened = await asyncio.gather(
            *(self._dispatcher.open(prompt.token_ids, batch) for prompt, batch in zip(prompts, batches, strict=True)),
            return_exceptions=True,
        )
        failure = next((result for result in opened if isinstance(result, BaseException)), None)
        if failure is None:
            return opened  # type: ignore[return-value]
        for result in opened:
            if not isinstance(result, BaseException):
                for stream in result:
                    stream.close("sibling_failed")
        raise failure

    async def _sse(
        self, generation: Generation, renderer: ChunkRenderer, num_choices: int, include_usage: bool, arrival_s: float
    ) -> AsyncGenerator[bytes, None]:
        # The chunk that finishes the last choice goes out together with the usage and [DONE]: one write
        # instead of three, and nothing waits (it is the end of the stream anyway).
        tail = b""
        unfinished = num_choices
        try:
            if opening := renderer.opening(num_choices):
                yield opening
            try:
                async for delta in generation.deltas():
                    chunk = renderer.delta(delta)
                    if delta.finish_reason is not None:
                        unfinished -= 1
                        if unfinished == 0:
                            tail = chunk
                            continue
                    if chunk:
                        yield chunk
                if include_usage:
                    tail += renderer.usage(generation.usage())
            except EngineStreamError as exc:
                logger.warning("stream ended by an engine failure: %s", exc)
                tail += error_event(engine_failure(str(exc)).body())
            yield tail + SSE_DONE
        finally:
            self._metrics.e2e_latency.observe(time.perf_counter() - arrival_s)

    async def _collect(
        self, generation: Generation, num_choices: int, http_request: Request
    ) -> list[ChoiceAccumulator]:
        """All deltas of a non-streamed request, aborting the engine requests if the client leaves."""
        choices = [ChoiceAccumulator(index) for index in range(num_choices)]

        async def consume() -> None:
            async for delta in generation.deltas():
                choices[delta.index].add(delta)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(http_request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()  # closes the engine streams, aborting them
            await asyncio.gather(consumer, watcher, return_exceptions=True)
        if consumer.cancelled():
            raise APIError(CLIENT_CLOSED_REQUEST, "the client closed the connection", type="client_disconnected")
        try:
            consumer.result()
        except EngineStreamError as exc:
            raise engine_failure(str(exc)) from exc
        return choices


def request_metadata() -> dict[str, str]:
    """The request's id and the gateway span's trace context, for every engine request (engine.proto
    ``GenerateRequest.metadata``): the engine's log lines and spans of the request name and join them."""
    metadata = {"x-request-id": current_request_id() or ""}
    inject(metadata)  # nothing when tracing is off (no current span)
    return metadata


def num_prompts(request: CompletionRequest) -> int:
    """A string or one list of token ids is one prompt; a list of strings or of id lists is one per entry."""
    prompt = request.prompt
    return 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)


def token_id_text(token_id: int) -> str:
    """``return_tokens_as_token_ids``: logprobs name tokens ``token_id:N`` (vLLM's form), unambiguous."""
    return f"token_id:{token_id}"


async def _unless_client_leaves(opening: Awaitable[T], http_request: Request) -> T:
    """``opening``'s result, or a 499 once the client hangs up: until its first token a request may wait long in an
    engine's queue or prefill, and nothing else reads the connection then.  Cancelling the opening aborts its engine
    requests (``Dispatcher`` abandons calls whose first response it was waiting for)."""
    task = asyncio.current_task()
    assert task is not None
    state = {"waiting": True, "left": False}

    def on_disconnect(watcher: asyncio.Task[None]) -> None:
        # Runs on a later turn of the loop: the opening may have returned by then.
        if state["waiting"] and not watcher.cancelled():
            state["left"] = True
            task.cancel()

    watcher = asyncio.get_running_loop().create_task(_wait_for_disconnect(http_request))
    watcher.add_done_callback(on_disconnect)
    try:
        return await opening
    except asyncio.CancelledError:
        if not state["left"]:
            raise
        task.uncancel()
        raise APIError(CLIENT_CLOSED_REQUEST, "the client closed the connection", type="client_disconnected") from None
    finally:
        state["waiting"] = False
        watcher.cancel()


async def _wait_for_disconnect(http_request: Request) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return
