"""Image and video preprocessing for the gateway (see ``pipeline.py`` for how the API uses it).

The public names load on first use (PEP 562): ``m3stack`` builds every subcommand's parser at startup
and the gateway's flags come from ``limits``, so importing this package must not pull in PyAV, Pillow
or numpy; only touching ``MediaPipeline`` and friends does.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .errors import MediaError
    from .limits import MediaLimits
    from .model_profile import ModelProfile, PlaceholderSpan
    from .pipeline import MediaPart, MediaPipeline, PlacedItem, ProcessedItem
    from .registry import load_profile, register_profile
    from .transport import Transport, WireDType

# public name -> the submodule that defines it
_SOURCES = {
    "MediaError": ".errors",
    "MediaLimits": ".limits",
    "MediaPart": ".pipeline",
    "MediaPipeline": ".pipeline",
    "PlacedItem": ".pipeline",
    "ProcessedItem": ".pipeline",
    "ModelProfile": ".model_profile",
    "PlaceholderSpan": ".model_profile",
    "load_profile": ".registry",
    "register_profile": ".registry",
    "Transport": ".transport",
    "WireDType": ".transport",
}

__all__ = [
    "MediaError",
    "MediaLimits",
    "MediaPart",
    "MediaPipeline",
    "ModelProfile",
    "PlacedItem",
    "PlaceholderSpan",
    "ProcessedItem",
    "Transport",
    "WireDType",
    "load_profile",
    "register_profile",
]


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
