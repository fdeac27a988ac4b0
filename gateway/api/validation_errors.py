"""pydantic's validation errors as one OpenAI error in plain words.

``param`` is the path the way OpenAI writes it (``messages[2].content[0].image_url``).  A value that fails a
union (``content``: a string or a list of parts; ``prompt``: a string, strings, token ids or lists of them)
makes pydantic report one error per branch, located under the branch's internal name
(``list[tagged-union[TextPart,ImagePart,VideoPart]]``).  Those names never reach the client: when one branch
took the value's shape (a list for a list branch) its own error is reported at the real path; otherwise the
message says what the field accepts, e.g. ``messages[0].content: expected a string or an array of objects
with a known 'type', got an integer``.
"""

import re
from collections.abc import Sequence
from typing import Any

from m3stack.gateway.errors import APIError

# A branch tag pydantic puts into ``loc``: a type name, never one of our snake_case field names.
_TAG_WRAPPER = re.compile(r"^([a-z][a-z-]*)\[(.*)\]$")
_SCALAR_NOUNS = {
    "str": ("string", "strings"),
    "int": ("integer", "integers"),
    "float": ("number", "numbers"),
    "bool": ("boolean", "booleans"),
    "bytes": ("string", "strings"),
    "none": ("null", "nulls"),
}
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")


def validation_error_body(errors: Sequence[Any]) -> dict[str, Any]:
    """The first error pydantic reports, as an OpenAI error body (status 400)."""
    errors = [error for error in errors if isinstance(error, dict)]
    if not errors:
        return APIError(400, "invalid request", code="invalid_value").body()
    first = errors[0]
    if first.get("type") == "json_invalid":
        message = f"The body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        return APIError(400, message, code="invalid_json").body()
    location = _strip_body(first.get("loc", ()))
    site = next(
        (
            index
            for index, part in enumerate(location)
            if _is_branch_tag(part) and len(_branches_at(errors, location[:index])) > 1
        ),
        None,
    )
    if site is None:
        return _error(location, str(first["msg"]))
    prefix = location[:site]
    branches = _branches_at(errors, prefix)
    chosen = _branch_that_took_the_shape(_with_every_required_field(branches, site))
    if chosen is not None:
        tag, error = chosen
        path = [*prefix, *_without_tags(tag, _strip_body(error["loc"])[site + 1 :])]
        return _error(path, str(error["msg"]))
    expected = _alternatives([_noun(tag)[0] for tag in branches])
    got = _kind(_site_input(branches))
    return _error(prefix, f"expected {expected}, got {got}")


def param_path(location: Sequence[Any]) -> str | None:
    """``("messages", 2, "tool_call_id")`` -> ``messages[2].tool_call_id``."""
    path = ""
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def _error(location: Sequence[Any], text: str) -> dict[str, Any]:
    param = param_path(_without_discriminators(location))
    message = f"{param}: {text}" if param else text
    return APIError(400, message, param=param, code="invalid_value").body()


def _strip_body(location: Sequence[Any]) -> list[Any]:
    return [part for part in location if part != "body"] if location and location[0] == "body" else list(location)


def _is_branch_tag(part: Any) -> bool:
    """A union branch's name, or else a field name or a key of a JSON object (``logit_bias``'s token ids).  Only
    where two or more branches failed is it taken for a branch: pydantic reports every branch of a union."""
    return isinstance(part, str) and (part in _SCALAR_NOUNS or not (_FIELD.match(part) or part.isdigit()))


def _without_discriminators(location: Sequence[Any]) -> list[Any]:
    """A tagged object's ``type`` value, which pydantic puts into ``loc`` before the object's own fields, left
    out: OpenAI's tagged objects name their payload after their type (``response_format.json_schema``, whose
    location is ``("response_format", "json_schema", "json_schema", "name")``), so it is the repeated part."""
    return [
        part
        for index, part in enumerate(location)
        if not (isinstance(part, str) and index + 1 < len(location) and location[index + 1] == part)
    ]


def _with_every_required_field(branches: dict[str, list[dict[str, Any]]], site: int) -> dict[str, list[dict[str, Any]]]:
    """The object branches the value has every required field of, when there are any: a chat sent to /tokenize
    is not a text prompt without one (``prompt: Field required``), whatever else it got wrong."""
    complete = {
        tag: errors
        for tag, errors in branches.items()
        if not any(e.get("type") == "missing" and len(_strip_body(e["loc"])) == site + 2 for e in errors)
    }
    return complete or branches


def _branches_at(errors: Sequence[dict[str, Any]], prefix: list[Any]) -> dict[str, list[dict[str, Any]]]:
    """The union's branches at ``prefix``, each with its errors, in pydantic's (declaration) order."""
    branches: dict[str, list[dict[str, Any]]] = {}
    for error in errors:
        location = _strip_body(error.get("loc", ()))
        if len(location) > len(prefix) and location[: len(prefix)] == prefix and _is_branch_tag(location[len(prefix)]):
            branches.setdefault(location[len(prefix)], []).append(error)
    return branches


def _branch_that_took_the_shape(branches: dict[str, list[dict[str, Any]]]) -> tuple[str, dict[str, Any]] | None:
    """The branch the value had the shape of (its errors lie inside the value, or are constraints such as a
    length rather than a wrong type): the one with the fewest such errors, or any of those tied when they all
    report the same first error.  Its first error is the one to report."""
    depth = min(len(_strip_body(error["loc"])) for errors in branches.values() for error in errors)
    shaped = {
        tag: [e for e in errors if len(_strip_body(e["loc"])) > depth or not _is_type_mismatch(e)]
        for tag, errors in branches.items()
    }
    shaped = {tag: errors for tag, errors in shaped.items() if errors}
    if not shaped:
        return None
    fewest = min(len(errors) for errors in shaped.values())
    best = [tag for tag, errors in shaped.items() if len(errors) == fewest]
    firsts = {
        (tuple(_without_tags(tag, _strip_body(shaped[tag][0]["loc"])[depth:])), shaped[tag][0]["msg"]) for tag in best
    }
    return (best[0], shaped[best[0]][0]) if len(firsts) == 1 else None


def _is_type_mismatch(error: dict[str, Any]) -> bool:
    kind = str(error.get("type", ""))
    return kind.endswith(("_type", "_parsing")) or kind in ("literal_error", "union_tag_not_found")


def _without_tags(tag: str, rest: list[Any]) -> list[Any]:
    """The path inside a branch without the tags pydantic adds: nested branch names, and a tagged union's
    discriminator value, which follows the list index (``list[tagged-union[...]]``) or the tag itself."""
    path = []
    skip_next_string = "tagged-union[" in tag and not tag.startswith("list[")
    for part in rest:
        if skip_next_string and isinstance(part, str):
            skip_next_string = False
            continue
        if isinstance(part, int) and tag.startswith("list[tagged-union["):
            skip_next_string = True
        if not (isinstance(part, str) and _is_branch_tag(part)):
            path.append(part)
    return path


def _site_input(branches: dict[str, list[dict[str, Any]]]) -> Any:
    depth = min(len(_strip_body(error["loc"])) for errors in branches.values() for error in errors)
    for errors in branches.values():
        for error in errors:
            if len(_strip_body(error["loc"])) == depth:
                return error.get("input")
    return None


def _noun(tag: str) -> tuple[str, str]:
    """Plain words for a branch tag: (with an article, plural)."""
    tag = tag.removeprefix("constrained-")
    if tag in _SCALAR_NOUNS:
        singular, plural = _SCALAR_NOUNS[tag]
        return (singular if tag == "none" else f"{_article(singular)} {singular}"), plural
    wrapper = _TAG_WRAPPER.match(tag)
    if wrapper is None:  # a model's class name
        return "an object", "objects"
    kind, inner = wrapper.groups()
    if kind in ("list", "tuple", "set", "frozenset"):
        items = _noun(inner)[1]
        return f"an array of {items}", f"arrays of {items}"
    if kind == "literal":  # ``literal['none','auto']``
        values = ", ".join(value.strip() for value in inner.split(","))
        return f"one of {values}", f"values among {values}"
    if kind == "tagged-union":
        return "an object with a known 'type'", "objects with a known 'type'"
    if kind.startswith("function-"):  # a validator around a type: ``function-after[name(), int]``
        return _noun(inner.rsplit(", ", 1)[-1])
    if kind == "nullable":
        singular, plural = _noun(inner)
        return f"{singular} or null", f"{plural} or nulls"
    return "an object", "objects"


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def _alternatives(nouns: list[str]) -> str:
    unique = list(dict.fromkeys(nouns))
    return unique[0] if len(unique) == 1 else ", ".join(unique[:-1]) + " or " + unique[-1]


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    return "an object"
