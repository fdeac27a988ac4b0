"""bench.mxfp8_gemv names each launch configuration in its tables; ``--tiles`` reads those names back, so the
``best`` of one run can be timed again or beside new candidates in the next."""

import argparse

import pytest

from bench.mxfp8_gemv import DENSE_MMAS, DENSE_SPLITS, GEMVS, GROUPED_MMAS, parse_tiles, short, tiles_list
from m3stack.engine.model.mxfp8_kernels import Tiles


def test_every_built_in_configuration_reads_back_from_its_name() -> None:
    for tiles in [*GEMVS, *GROUPED_MMAS, *DENSE_MMAS, *DENSE_SPLITS]:
        assert parse_tiles(short(tiles)) == tiles


def test_a_list_of_names_gives_each_configuration_in_order() -> None:
    assert tiles_list("mma0 swap_ab 128x128x64 w8 s4, mma2 16x64x128 w4 s4 split2,") == [
        Tiles(128, 128, 64, 8, 4, widen=0, swap_ab=True),
        Tiles(16, 64, 128, 4, 4, widen=2, split_k=2),
    ]


@pytest.mark.parametrize(
    "name",
    [
        "mma0 swap_ab 128x128 w8 s4",
        "swap_ab 32x128x128 w4 s4",
        "mma0 32x128x128 w4",
        "gemv 16x16x512 w4 s1",
        "mma0 1x16x512 w4 s1",
    ],
)
def test_a_name_that_is_no_configuration_is_refused(name: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="configuration"):
        parse_tiles(name)
