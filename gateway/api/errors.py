"""Errors as HTTP responses: what FastAPI's exception handlers and the completion fast path send."""

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from m3stack.gateway.errors import APIError

# FastAPI's only 400 is a body it could not parse as JSON for a reason other than its syntax (not UTF-8, nested
# deeper than the parser goes, an integer of more digits than Python converts): invalid JSON all the same.
HTTP_ERROR_CODES = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def api_error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def http_error_response(exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's HTTP errors (unknown path, wrong method, body too large) in the OpenAI shape."""
    code = HTTP_ERROR_CODES.get(exc.status_code, str(exc.status_code))
    error = APIError(exc.status_code, str(exc.detail), code=code)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))
