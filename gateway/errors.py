"""Errors a client sees, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every layer raises ``APIError``; the HTTP layer renders it with its status (and headers such as
``Retry-After``), or as an ``error`` event when the stream has already started.
"""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model {model!r} does not exist; this server serves {served!r}",
        param="model",
        code="model_not_found",
    )


def not_supported(what: str, param: str | None = None) -> APIError:
    return APIError(400, f"{what} is not supported by this server", param=param, code="unsupported_parameter")


def no_engine_available(retry_after_s: float, detail: str) -> APIError:
    seconds = max(1, round(retry_after_s))
    return APIError(
        503,
        f"No engine can take the request right now ({detail}); retry in {seconds}s",
        type="server_error",
        code="engine_unavailable",
        headers={"Retry-After": str(seconds)},
    )


def engine_failure(message: str) -> APIError:
    return APIError(502, message, type="server_error", code="engine_error")
