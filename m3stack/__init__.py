"""m3stack: serve MiniMax-M3-class models on Kubernetes or on one machine.

Components live in top-level folders and import as ``m3stack.engine``, ``m3stack.gateway`` and
``m3stack.operator`` (see setup.py for the mapping).
"""

from pathlib import Path

__version__ = "0.1.0"

# operator/ has no __init__.py, so a checkout's root on sys.path never shadows the stdlib
# ``operator`` module; that makes m3stack.operator a namespace package.  setuptools' editable
# finder cannot resolve a namespace package nested in a regular one, so in a source checkout we
# let the import system search the checkout root for m3stack's children (a wheel install copies
# operator/ under m3stack/ and needs nothing).
_CHECKOUT_ROOT = Path(__file__).resolve().parent.parent
if (_CHECKOUT_ROOT / "setup.py").is_file() and (_CHECKOUT_ROOT / "operator").is_dir():
    __path__.append(str(_CHECKOUT_ROOT))
