"""Limits a request meets before the gateway spends work on it: how many sequences it fans out to, and whether
its text can fit the context at all.

A request the engines could never hold is a 400 naming the limit, at once: a 503 would tell the client to
retry what retrying cannot fix.  A prompt whose length alone proves it is over the context is refused
without tokenizing it (tokenizing 20 MB took 10 s of CPU); the body-size cap (413) comes before both, in
``RequestGuard``.
"""

from dataclasses import dataclass

from m3stack.gateway.errors import APIError, invalid_request

# A body this size is read and parsed in ~25 ms of gateway CPU (bench/oversized_requests.py: ~3.2 ms per MiB),
# so even a refused one at the cap stays well under 50 ms; larger images and videos go by URL.
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
DEFAULT_MAX_PROMPTS = 256
DEFAULT_MAX_SEQUENCES = 256


@dataclass(frozen=True)
class RequestLimits:
    max_prompts: int = DEFAULT_MAX_PROMPTS  # prompts in one /v1/completions request
    max_sequences: int = DEFAULT_MAX_SEQUENCES  # prompts x n: engine requests one request starts

    def check_fan_out(self, prompts: int, n: int, engine_queue_capacity: int | None) -> None:
        """``engine_queue_capacity``: the waiting-queue sizes of the routable engines, summed (None: unknown)."""
        if prompts > self.max_prompts:
            raise invalid_request(
                f"{prompts} prompts exceed the limit of {self.max_prompts} per request (--max-request-prompts); "
                "send them in several requests",
                param="prompt",
                code="too_many_prompts",
            )
        sequences = prompts * n
        if sequences > self.max_sequences:
            raise invalid_request(
                f"{prompts} prompt(s) x n={n} = {sequences} sequences exceed the limit of {self.max_sequences} per "
                "request (--max-request-sequences); lower n or send fewer prompts per request",
                param="n",
                code="too_many_sequences",
            )
        if engine_queue_capacity is not None and sequences > engine_queue_capacity:
            raise invalid_request(
                f"{sequences} sequences exceed what the engines can queue at once ({engine_queue_capacity} requests "
                "in all, their --max-queue); lower n or send fewer prompts per request",
                param="n",
                code="too_many_sequences",
            )


def check_prompt_length(chars: int, context: int, max_chars_per_token: int | None, param: str) -> None:
    """Refuse a text of ``chars`` characters that has at least ``context`` tokens whatever they are: no token of
    the model stands for more than ``max_chars_per_token`` characters (see ``ModelTokenizer``)."""
    if max_chars_per_token is None or chars < context * max_chars_per_token:
        return
    at_least = -(-chars // max_chars_per_token)
    raise APIError(
        400,
        f"This model's maximum context length is {context} tokens, but the prompt has at least {at_least} tokens "
        f"({chars} characters; no token of this model stands for more than {max_chars_per_token}). "
        "Shorten the prompt.",
        param=param,
        code="context_length_exceeded",
    )
