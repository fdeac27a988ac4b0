"""One configuration style for every ``m3stack`` subcommand: flags with matching environment variables.

Each flag ``--some-flag`` of subcommand ``cmd`` can also be set with ``M3STACK_CMD_SOME_FLAG``
(the flag wins).  Values from either source go through the same validator, and a bad value ends the
program with exit code 2 and a message naming the flag or variable, as argparse does for flags.
"""

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

ENV_PREFIX = "M3STACK_"


def env_name(command: str, flag: str) -> str:
    """``("engine", "--kv-offload-gb")`` -> ``"M3STACK_ENGINE_KV_OFFLOAD_GB"``."""
    return f"{ENV_PREFIX}{command}_{flag.lstrip('-')}".upper().replace("-", "_")


class OptionGroup:
    """Adds flags to one subcommand's parser with environment-variable defaults."""

    def __init__(self, parser: argparse.ArgumentParser, command: str) -> None:
        self.parser = parser
        self.command = command

    def add(
        self,
        flag: str,
        *,
        type: Callable[[str], Any] = str,
        default: Any = None,
        help: str,
        choices: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        variable = env_name(self.command, flag)
        raw = os.environ.get(variable)
        if raw is not None:
            default = self._convert(variable, raw, type, choices)
        shown = "" if default is None else f" (default: {default})"
        self.parser.add_argument(
            flag,
            type=type,
            default=default,
            choices=choices,
            help=f"{help}{shown} [env: {variable}]",
            **kwargs,
        )

    def flag(self, flag: str, *, help: str, default: bool = False) -> None:
        """A boolean switch (``--no-<flag>`` turns it off); the variable accepts 1/0, true/false, yes/no, on/off."""
        variable = env_name(self.command, flag)
        raw = os.environ.get(variable)
        if raw is not None:
            default = self._convert(variable, raw, boolean, None)
        self.parser.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=default,
            help=f"{help} [env: {variable}]",
        )

    def _convert(self, variable: str, raw: str, type: Callable[[str], Any], choices: list[str] | None) -> Any:
        try:
            value = type(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            self.parser.error(f"environment variable {variable}={raw!r}: {exc}")
        if choices is not None and value not in choices:
            self.parser.error(f"environment variable {variable}={raw!r}: choose from {', '.join(choices)}")
        return value


# ------------------------------------------------------------------------------------------------
# Validators: each raises argparse.ArgumentTypeError with a message a user can act on.


def boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def port(text: str) -> int:
    value = _integer(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"a TCP port must be in 1..65535, got {value}")
    return value


def positive_int(text: str) -> int:
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def fraction(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {value}")
    return value


def host_port(text: str) -> tuple[str, int]:
    """``"10.0.0.1:50051"`` or ``"[::1]:50051"`` -> (host, port)."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    host = host.removeprefix("[").removesuffix("]")
    return host, port(port_text)


def host_port_list(text: str) -> list[tuple[str, int]]:
    """A comma-separated list of HOST:PORT."""
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected at least one HOST:PORT")
    return [host_port(item) for item in items]


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value
