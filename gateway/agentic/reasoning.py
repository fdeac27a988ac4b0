"""M3's thinking modes: the deployment's default (``--thinking-mode``) and a request's choice.

M3's chat template reads ``thinking_mode``: ``enabled`` opens the reasoning in the generation prompt, ``disabled``
closes it there, ``adaptive`` (the template's own default) lets the model decide.  A request picks one in
``chat_template_kwargs``, as ``thinking_mode`` or as the ``enable_thinking`` / ``thinking`` booleans other stacks'
clients send; the reasoning the model writes comes back split into ``reasoning_content``.
"""

from collections.abc import Mapping
from typing import Any

from m3stack.gateway.errors import invalid_request

THINKING_MODES = ("adaptive", "enabled", "disabled")
THINKING_MODE_VARIABLE = "thinking_mode"
_BOOLEAN_SWITCHES = ("enable_thinking", "thinking")


def thinking_mode(default: str, template_kwargs: Mapping[str, Any] | None) -> str:
    """The mode a request runs in: its ``chat_template_kwargs`` choice, else the deployment's ``default``."""
    kwargs = template_kwargs or {}
    if THINKING_MODE_VARIABLE in kwargs:
        mode = kwargs[THINKING_MODE_VARIABLE]
        if mode not in THINKING_MODES:
            raise invalid_request(
                f"chat_template_kwargs.thinking_mode must be one of {', '.join(THINKING_MODES)}, not {mode!r}",
                param="chat_template_kwargs.thinking_mode",
            )
        return str(mode)
    for switch in _BOOLEAN_SWITCHES:
        if switch in kwargs:
            value = kwargs[switch]
            if not isinstance(value, bool):
                raise invalid_request(
                    f"chat_template_kwargs.{switch} must be true or false", param=f"chat_template_kwargs.{switch}"
                )
            return "enabled" if value else "disabled"
    return default
