"""Print the requirements of m3stack's core and the given extras (pyproject.toml), one a line.

Each image installs its dependencies from this list in a layer of their own, before it copies the
source: a change to the code, or to pyproject.toml's tool settings, leaves that layer (torch's
gigabytes in the engine image) as it was.  Standard library only: it runs in the images' build stage
on a bare Python.

    python3 images/requirements.py pyproject.toml engine [--exclude torch]
"""

import argparse
import re
import sys
import tomllib
from pathlib import Path

# `m3stack[a,b]` inside an extra names other extras of the project itself.
SELF_REFERENCE = re.compile(r"m3stack\[(?P<extras>[^\]]*)\]")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def requirements(project: dict, extras: list[str], exclude: frozenset[str] = frozenset()) -> list[str]:
    """The core dependencies plus those of ``extras`` (following ``m3stack[...]`` references), in order,
    without repeats; ``exclude``: names left out (compared case- and separator-insensitively)."""
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise ValueError(f"no such extra in pyproject.toml: {', '.join(unknown)} (known: {', '.join(optional)})")
    found = list(project.get("dependencies", []))
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in optional[extra]:
            inner = SELF_REFERENCE.fullmatch(requirement)
            if inner:
                todo += [name.strip() for name in inner.group("extras").split(",")]
            else:
                found.append(requirement)
    excluded = {_canonical(name) for name in exclude}
    return [text for text in dict.fromkeys(found) if _canonical(_name(text)) not in excluded]


def _name(requirement: str) -> str:
    match = NAME.match(requirement.strip())
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return match.group()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("extras", nargs="+")
    parser.add_argument("--exclude", action="append", default=[], help="leave out this distribution (repeatable)")
    args = parser.parse_args(argv)
    project = tomllib.loads(args.pyproject.read_text())["project"]
    try:
        lines = requirements(project, args.extras, frozenset(args.exclude))
    except ValueError as error:
        parser.error(str(error))
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
