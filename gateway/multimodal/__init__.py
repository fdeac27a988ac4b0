"""Image and video preprocessing for the gateway (see ``pipeline.py`` for how the API uses it)."""

from .errors import MediaError
from .limits import MediaLimits
from .pipeline import MediaPart, MediaPipeline, ProcessedItem
from .spec import ModelProfile, PlaceholderSpan, load_profile, register_profile
from .transport import Transport, WireDType

__all__ = [
    "MediaError",
    "MediaLimits",
    "MediaPart",
    "MediaPipeline",
    "ModelProfile",
    "PlaceholderSpan",
    "ProcessedItem",
    "Transport",
    "WireDType",
    "load_profile",
    "register_profile",
]
