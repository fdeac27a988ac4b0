"""DEBUG lines for each request's admission and end, naming the client's request id.

Per-request lines stay at DEBUG: at INFO, two lines a request would cost the event loop and the engine
thread real time at thousands of requests a second.  Admission is logged in the request's own context
(the gRPC handler's); the end is logged on the engine thread, so the id goes on the record itself.
"""

import logging

from m3stack.engine.runtime.request import Request
from m3stack.engine.server.metrics import FinishedRequest

logger = logging.getLogger(__name__)


def log_admitted(request: Request) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "admitting %s: %d prompt tokens, %d multimodal items",
            request.request_id,
            request.num_prompt_tokens,
            len(request.mm_inputs),
        )


def log_finished(finished: FinishedRequest) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        request = finished.request
        logger.debug(
            "finished %s (%s): %d prompt tokens (%d cached), %d generated",
            request.request_id,
            finished.finish_reason,
            finished.prompt_tokens,
            finished.cached_tokens,
            finished.generation_tokens,
            extra={"request_id": request.metadata.get("x-request-id")},
        )
