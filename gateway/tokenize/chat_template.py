"""Render a conversation with the model's Jinja chat template, the way ``transformers`` does.

Chat templates come from model repositories, so they are untrusted code: they run in Jinja's
immutable sandbox with the same environment ``transformers`` builds (``trim_blocks``,
``lstrip_blocks``, loop controls, its ``tojson``, ``raise_exception`` and ``strftime_now``, and the
``{% generation %}`` block, which only marks text for training and renders its body unchanged here).
"""

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Variables the renderer sets itself; extra template variables from a request may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatTemplateError(ValueError):
    """The template rejected the conversation (``raise_exception``) or failed to render it."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body as is."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 reads this class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
    return datetime.datetime.now().strftime(format_string)


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to (``bos_token``...)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self._special_tokens = dict(special_tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        extra_variables: Mapping[str, Any] | None = None,
    ) -> str:
        caller_variables = {k: v for k, v in (extra_variables or {}).items() if k not in RESERVED_VARIABLES}
        variables = {**self._special_tokens, **caller_variables}
        try:
            return self._template.render(
                messages=list(messages),
                tools=list(tools) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        # Templates index and concatenate whatever the client sent, so ordinary Python errors are bad
        # input too (e.g. a list where the template expects a string).
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
