"""The document's vocabulary bounds as pure functions: the token-id pattern against every number around it."""

import re

import pytest

from m3stack.gateway.api.openapi_document import decimal_below, with_vocabulary
from m3stack.gateway.schemas import UINT32_MAX


@pytest.mark.parametrize("bound", [1, 2, 9, 10, 11, 20, 99, 100, 101, 200, 431, 1000, 1001, 4097])
def test_the_key_pattern_matches_exactly_the_numbers_below_the_bound(bound):
    pattern = re.compile(decimal_below(bound))
    for number in range(0, 2 * bound + 20):
        assert bool(pattern.match(str(number))) == (number < bound), (bound, number)
    assert pattern.match("0" * 3 + str(bound - 1)) and not pattern.match("0" + str(bound))
    for other in ("", "-1", "1.0", " 1", "a", "1e2"):
        assert not pattern.match(other), other


def test_a_real_vocabulary_size():
    pattern = re.compile(decimal_below(200_064))
    assert pattern.match("200063") and pattern.match("199999") and pattern.match("0")
    assert not pattern.match("200064") and not pattern.match("999999") and not pattern.match("1000000")


def test_only_token_id_integers_are_rebounded():
    document = {
        "components": {
            "schemas": {
                "Request": {
                    "properties": {
                        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": UINT32_MAX}},
                        "priority": {"type": "integer", "maximum": 2**31 - 1},
                        "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"}},
                    }
                }
            }
        }
    }
    properties = with_vocabulary(document, 431)["components"]["schemas"]["Request"]["properties"]
    assert properties["ids"]["items"]["maximum"] == 430
    assert properties["priority"]["maximum"] == 2**31 - 1
    assert properties["logit_bias"]["propertyNames"] == {"pattern": decimal_below(431)}
