"""The OpenAPI document of one gateway: FastAPI's, from the request models, with the bounds of the model it serves.

The request models are the same for every model, so their token ids are bounded only by the wire's uint32; the
gateway refuses an id outside its vocabulary by a check of its own (a 400 naming the field).  A gateway serves
one tokenizer, so its document states that bound too: token ids (``prompt``, ``stop_token_ids``, ``/detokenize``
``tokens``) at most ``vocab_size - 1``, ``logit_bias`` keys the decimal numbers below ``vocab_size``.

Not stated: the context length, which bounds a prompt plus ``max_tokens``.  It is what the engines report once
they are up (``GET /v1/models`` gives it as ``max_model_len``), it can change when engines restart with other
flags, and it bounds a sum of a field and the prompt's token count, which JSON Schema cannot express.
"""

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from m3stack.gateway.schemas import UINT32_MAX

LOGIT_BIAS_FIELD = "logit_bias"


def serve_with_vocabulary(app: FastAPI, vocab_size: int) -> None:
    """``app`` publishes its document with token ids bounded by ``vocab_size`` (built once, on first request)."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = with_vocabulary(build(), vocab_size)
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]


def with_vocabulary(document: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """``document`` with every token id schema (an integer up to the wire's uint32) bounded by ``vocab_size``."""
    for schema in document.get("components", {}).get("schemas", {}).values():
        _bound_token_ids(schema, vocab_size)
        bias = schema.get("properties", {}).get(LOGIT_BIAS_FIELD)
        if bias is not None and "propertyNames" in bias:
            bias["propertyNames"] = {"pattern": decimal_below(vocab_size)}
            bias["description"] = f"{bias.get('description', '')} (token ids below {vocab_size})".lstrip()
    return document


def _bound_token_ids(node: Any, vocab_size: int) -> None:
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("maximum") == UINT32_MAX:
            node["maximum"] = vocab_size - 1
        for value in node.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size)


def decimal_below(bound: int) -> str:
    """A regular expression matching the decimal numbers 0 .. ``bound - 1`` (leading zeros allowed, as the
    gateway reads a key with ``int``)."""
    if bound < 1:
        raise ValueError("bound must be at least 1")
    top = str(bound - 1)
    width = len(top)
    alternatives = []
    if width > 1:  # every number with fewer digits
        alternatives.append("[0-9]" if width == 2 else f"[0-9]|[1-9][0-9]{{1,{width - 2}}}")
    for position, digit in enumerate(top):
        # ``top``'s first ``position`` digits, then a smaller digit, then anything.
        lowest = 1 if position == 0 and width > 1 else 0
        if int(digit) > lowest:
            smaller = f"[{lowest}-{int(digit) - 1}]" if int(digit) - 1 > lowest else str(lowest)
            rest = width - position - 1
            alternatives.append(top[:position] + smaller + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(top)
    return f"^0*(?:{'|'.join(alternatives)})$"
