"""The package resolves its public names on first use, so importing it (or its limits) stays light."""

import importlib
import subprocess
import sys

import pytest

from m3stack.gateway import multimodal

HEAVY_MODULES = ("av", "PIL", "torch", "numpy")


def _loaded_after(code: str) -> list[str]:
    probe = f"{code}\nimport sys\nprint(*sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_package_and_its_limits_import_no_heavy_library():
    assert _loaded_after("import m3stack.gateway.multimodal.limits") == []
    assert _loaded_after("from m3stack.gateway.multimodal import MediaError, MediaLimits, limits") == []


def test_the_pipeline_loads_its_libraries_on_first_use():
    # The control for the test above: the same probe does see PyAV and Pillow once they are needed.
    loaded = _loaded_after("from m3stack.gateway.multimodal import MediaPipeline")
    assert {"av", "PIL", "numpy"} <= set(loaded)


@pytest.mark.parametrize("name", multimodal.__all__)
def test_every_public_name_is_the_defining_modules_object(name):
    value = getattr(multimodal, name)
    defining = importlib.import_module(value.__module__)
    assert getattr(defining, name) is value
    assert name in dir(multimodal)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        multimodal.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        from m3stack.gateway.multimodal import no_such_name  # noqa: F401
