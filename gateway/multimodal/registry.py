"""The ordered registry of the vision models the media pipeline knows, keyed by ``config.json`` ``model_type``.

Lookup goes in registration order, built-in models first: no pattern matching over an unordered map.  A model is
one module (its constants, frame sampler and prompt layout) plus one line below.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import m3, qwen2_vl
from .model_profile import ModelProfile

ProfileFactory = Callable[[Path | None], ModelProfile]


@dataclass
class ProfileRegistry:
    """``model_type`` -> profile factory, first registration wins; factories read the checkpoint folder."""

    _entries: list[tuple[str, ProfileFactory]] = field(default_factory=list)

    def register(self, model_type: str, factory: ProfileFactory) -> None:
        if any(name == model_type for name, _ in self._entries):
            raise ValueError(f"a profile for model_type {model_type!r} is already registered")
        self._entries.append((model_type, factory))

    def model_types(self) -> list[str]:
        return [name for name, _ in self._entries]

    def load(self, model_type: str, checkpoint: Path | None = None) -> ModelProfile:
        for name, factory in self._entries:
            if name == model_type:
                return factory(checkpoint)
        raise KeyError(f"no multimodal profile for model_type {model_type!r}; known: {', '.join(self.model_types())}")


REGISTRY = ProfileRegistry()
# The built-in profiles, in lookup order.  A new model adds one line here.
REGISTRY.register(m3.MODEL_TYPE, m3.profile)
REGISTRY.register(qwen2_vl.MODEL_TYPE, qwen2_vl.profile)


def register_profile(model_type: str, factory: ProfileFactory) -> None:
    REGISTRY.register(model_type, factory)


def load_profile(model_type: str, checkpoint: Path | None = None) -> ModelProfile:
    """The profile for a checkpoint's ``model_type``."""
    return REGISTRY.load(model_type, checkpoint)
