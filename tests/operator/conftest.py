"""Builders shared by the operator's pure tests."""

import copy
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from m3stack.operator.render import Images
from m3stack.operator.spec import M3Deployment

IMAGES = Images(engine="registry.test/engine:1", gateway="registry.test/gateway:1")


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def body(spec: dict[str, Any] | None = None, *, name: str = "demo", namespace: str = "models") -> dict[str, Any]:
    """An M3Deployment as the API server returns it (identity filled in), with ``spec`` merged over a minimal one."""
    return {
        "apiVersion": "m3stack.io/v1alpha1",
        "kind": "M3Deployment",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": 3},
        "spec": _merge({"model": {"name": "m3-tiny"}}, spec or {}),
    }


@pytest.fixture
def images() -> Images:
    return IMAGES


@pytest.fixture
def make_m3d() -> Callable[..., M3Deployment]:
    def make(spec: dict[str, Any] | None = None, **identity: str) -> M3Deployment:
        return M3Deployment.from_body(body(spec, **identity))

    return make


@pytest.fixture(scope="session")
def images_script(repo_root) -> Callable[[str], ModuleType]:
    """Loads a script of images/ (standard-library Python run outside the package) as a module."""

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"images_{name}", repo_root / "images" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
        return module

    return load
