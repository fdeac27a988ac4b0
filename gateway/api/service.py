"""The completions pipeline behind the routes: prompt -> engine requests -> streams -> response.

Route functions stay thin; this is where a request is checked against the model, dispatched,
and turned into an SSE stream or a JSON body.  Failures before the first token become HTTP errors;
after it (streaming), an ``error`` event ends the stream.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from m3stack.gateway.api import params
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
from m3stack.gateway.api.schemas import ChatCompletionRequest, CompletionRequest
from m3stack.gateway.api.sse import EventStreamResponse
from m3stack.gateway.engines.pool import EnginePool
from m3stack.gateway.errors import APIError, engine_failure, model_not_found, no_engine_available
from m3stack.gateway.generation.choice import ChoiceDecoder
from m3stack.gateway.generation.dispatch import Dispatcher, EngineStream, EngineStreamError
from m3stack.gateway.generation.run import ChoiceRun, Generation
from m3stack.gateway.metrics import GatewayMetrics
from m3stack.gateway.tokenize.tokenizer import ModelTokenizer

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's code for "the client went away first": metrics only
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class CompletionService:
    def __init__(
        self,
        served_model_name: str,
        tokenizer: ModelTokenizer,
        prompts: PromptBuilder,
        pool: EnginePool,
        dispatcher: Dispatcher,
        metrics: GatewayMetrics,
    ) -> None:
        self.served_model_name = served_model_name
        self._tokenizer = tokenizer
        self._prompts = prompts
        self._pool = pool
        self._dispatcher = dispatcher
        self._metrics = metrics

    def check_model(self, model: str) -> None:
        if model != self.served_model_name:
            raise model_not_found(model, self.served_model_name)

    async def chat(self, request: ChatCompletionRequest, http_request: Request, arrival_s: float) -> Response:
        self.check_model(request.model)
        params.reject_unsupported(request)
        context = self._context_length()
        prompt = await self._prompts.chat(request, context)
        return await self._serve("chat", request, [prompt], context, http_request, arrival_s)

    async def completions(self, request: CompletionRequest, http_request: Request, arrival_s: float) -> Response:
        self.check_model(request.model)
        params.reject_unsupported(request)
        context = self._context_length()
        prompts = await self._prompts.completion(request)
        return await self._serve("completion", request, prompts, context, http_request, arrival_s)

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
    ) -> Response:
        output = params.output_options(request)
        requested, max_param = params.requested_max_tokens(request)
        prompt_param = "messages" if kind == "chat" else "prompt"
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        batches = []
        for prompt_index, prompt in enumerate(prompts):
            max_new = params.max_new_tokens(requested, max_param, len(prompt.token_ids), context, prompt_param)
            sampling = params.sampling_params(request, max_new, output, self._tokenizer.vocab_size)
            batches.append(
                params.engine_requests(
                    request_id, prompt.token_ids, prompt.mm_items, sampling, request, prompt_index * request.n
                )
            )
        streams = await self._open_all(prompts, batches)
        self._metrics.prompt_tokens.inc(sum(len(prompt.token_ids) for prompt in prompts))
        runs = [
            ChoiceRun(
                stream,
                ChoiceDecoder(
                    prompt_index * request.n + i,
                    self._tokenizer,
                    prompt.token_ids,
                    output.stop_strings,
                    output.skip_special_tokens,
                    self._tokenizer.eos_token_ids,
                ),
                prompt_index,
            )
            for prompt_index, (prompt, prompt_streams) in enumerate(zip(prompts, streams, strict=True))
            for i, stream in enumerate(prompt_streams)
        ]
        generation = Generation(runs, self._metrics, arrival_s)
        token_text = token_id_text if request.return_tokens_as_token_ids else self._tokenizer.token_text
        meta = ResponseMeta(request_id, self.served_model_name, int(time.time()), token_text, output.logprobs)
        echo = isinstance(request, CompletionRequest) and request.echo
        echo_texts = [prompt.text or "" for prompt in prompts for _ in range(request.n)] if echo else []
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            renderer = ChunkRenderer(kind, meta, include_usage, len(runs), echo_texts)
            body = self._sse(generation, renderer, len(runs), include_usage, arrival_s)
            return EventStreamResponse(body, headers=SSE_HEADERS)
        choices = await self._collect(generation, len(runs), http_request)
        usage = generation.usage()
        if kind == "chat":
            payload: BaseModel = chat_response(meta, choices, usage)
        else:
            payload = completion_response(meta, choices, usage, echo_texts)
        self._metrics.e2e_latency.observe(time.perf_counter() - arrival_s)
        return JSONResponse(payload.model_dump(mode="json"))

    async def _open_all(
        self, prompts: Sequence[Prompt], batches: Sequence[Sequence[object]]
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


def token_id_text(token_id: int) -> str:
    """``return_tokens_as_token_ids``: logprobs name tokens ``token_id:N`` (vLLM's form), unambiguous."""
    return f"token_id:{token_id}"


async def _wait_for_disconnect(http_request: Request) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return
