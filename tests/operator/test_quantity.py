"""Kubernetes quantities: parsing, formatting, and agreement with the CRD's quantity pattern."""

import re
from decimal import Decimal

import pytest

from m3stack.operator.quantity import format_bytes, parse_quantity
from m3stack.operator.schema import QUANTITY_PATTERN


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("512Gi", Decimal(512 * 2**30)),
        ("1.5G", Decimal(1_500_000_000)),
        ("500m", Decimal("0.5")),
        ("1e3", Decimal(1000)),
        ("2Ki", Decimal(2048)),
        (".5Mi", Decimal(2**19)),
        ("0", Decimal(0)),
        (8, Decimal(8)),
    ],
)
def test_parse(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["lots", "1.2.3", "Gi", "5 Gi", "5GB", "-", ""])
def test_parse_refuses_what_kubernetes_refuses(text):
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)
    assert re.match(QUANTITY_PATTERN, text) is None


@pytest.mark.parametrize("text", ["512Gi", "1.5G", "500m", "1e3", "+3", "-2k", "7E", "0.25Ti"])
def test_the_crd_pattern_accepts_what_the_parser_accepts(text):
    assert re.match(QUANTITY_PATTERN, text)
    parse_quantity(text)


@pytest.mark.parametrize(
    ("amount", "text"),
    [(64 * 2**30, "64Gi"), (3 * 2**29, "1536Mi"), (1000, "1000"), (2**40, "1Ti"), (0, "0"), (Decimal("0.5"), "1")],
)
def test_format_bytes(amount, text):
    assert format_bytes(amount) == text


@pytest.mark.parametrize("text", ["16Gi", "576Gi", "1Ki", "3Mi", "5Ti"])
def test_format_inverts_parse_for_whole_binary_units(text):
    assert format_bytes(parse_quantity(text)) == text
