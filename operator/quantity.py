"""Kubernetes resource quantities (``512Gi``, ``1.5G``, ``500m``, ``1e3``) as exact numbers, and back."""

import math
import re
from decimal import Decimal

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1)}
_DECIMAL.update({"k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12)})
_DECIMAL.update({"P": Decimal(10**15), "E": Decimal(10**18)})
_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")


def parse_quantity(value: str | int) -> Decimal:
    """``"512Gi"`` -> ``Decimal(549755813888)``; raises ValueError naming the bad text."""
    if isinstance(value, int):
        return Decimal(value)
    match = _QUANTITY.match(value.strip())
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = Decimal(match.group(1)), match.group(2) or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    return number * Decimal(10) ** int(suffix[1:])


def format_bytes(amount: Decimal | int) -> str:
    """Bytes as the largest exact binary unit: ``68719476736`` -> ``"64Gi"``; fractions round up to a byte."""
    whole = math.ceil(Decimal(amount))
    for suffix, size in reversed(_BINARY.items()):
        if whole and whole % size == 0:
            return f"{whole // size}{suffix}"
    return str(whole)
