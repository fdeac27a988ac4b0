"""The one error type of the media pipeline: bad, unreachable or oversized media is the client's fault."""

from dataclasses import dataclass


@dataclass
class MediaError(Exception):
    """A media part the gateway refuses; the API renders it as an OpenAI-shaped error with ``status``.

    ``code`` is machine-readable (``invalid_media``, ``media_too_large``, ``media_fetch_failed``,
    ``media_timeout``, ``too_many_media_items``, ``context_length_exceeded``); ``param`` points at the
    offending request field when the pipeline knows it (e.g. ``messages[0].content[1]``).
    """

    message: str
    code: str = "invalid_media"
    status: int = 400
    param: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def at(self, param: str | None) -> "MediaError":
        """Point the error at ``param`` unless it already points somewhere."""
        if self.param is None:
            self.param = param
        return self
