"""Map the top-level component folders onto the ``m3stack.*`` import paths.

pyproject.toml holds all metadata; this file only lists packages, because setuptools cannot
discover packages whose folder name differs from their import name.  ``operator/`` deliberately
has no ``__init__.py``: a regular package there would shadow the standard library's ``operator``
for anything run from the repository root.
"""

from pathlib import Path

from setuptools import setup

COMPONENT_FOLDERS = {
    "m3stack": "m3stack",
    "m3stack.engine": "engine",
    "m3stack.gateway": "gateway",
    "m3stack.operator": "operator",
}


def _packages() -> list[str]:
    names = []
    for package, folder in COMPONENT_FOLDERS.items():
        for directory in sorted({p.parent for p in Path(folder).rglob("*.py")} | {Path(folder)}):
            if "__pycache__" in directory.parts:
                continue
            relative = directory.relative_to(folder)
            names.append(".".join([package, *relative.parts]))
    return names


setup(package_dir=COMPONENT_FOLDERS, packages=_packages())
