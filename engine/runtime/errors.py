"""Errors a request can end with, by the gRPC status the server maps them to (engine.proto's list)."""

import enum


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    ALREADY_EXISTS = "already_exists"
    INTERNAL = "internal"


class EngineError(Exception):
    """A request-level failure: the request ends, the engine keeps running."""

    code = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequestError(EngineError):
    code = ErrorCode.INVALID_ARGUMENT


class QueueFullError(EngineError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class EngineUnavailableError(EngineError):
    code = ErrorCode.UNAVAILABLE


class DuplicateRequestError(EngineError):
    code = ErrorCode.ALREADY_EXISTS
