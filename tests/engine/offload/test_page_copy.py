"""Page copies (Triton under the CPU interpreter, and the PyTorch path) against a plain loop over the pairs."""

import pytest
import torch

from m3stack.engine.offload.page_copy import CopyConfig, copy_pages


@pytest.mark.parametrize(
    ("torch_only", "config"),
    [(False, None), (True, None), (False, CopyConfig(chunk_elements=32, programs_per_sm=1, num_warps=2))],
    ids=["triton", "torch", "triton-small-chunks"],
)
def test_copies_the_listed_pages_of_every_plane_up_to_count(torch_only, config):
    generator = torch.Generator().manual_seed(7)
    src = torch.randn((3, 7, 2, 16, 8), generator=generator)
    dst = torch.full((3, 5, 2, 16, 8), float("nan"))
    src_index = torch.tensor([4, 0, 6], dtype=torch.int32)
    dst_index = torch.tensor([2, 4, 0], dtype=torch.int32)
    count = torch.tensor([2], dtype=torch.int32)
    copy_pages(src, dst, src_index, dst_index, count, torch_only=torch_only, config=config)
    expected = torch.full_like(dst, float("nan"))
    for s, d in [(4, 2), (0, 4)]:
        for plane in range(3):
            expected[plane, d] = src[plane, s]
    torch.testing.assert_close(dst, expected, equal_nan=True, rtol=0, atol=0)


def test_pages_that_are_not_contiguous_are_refused():
    src = torch.zeros((2, 4, 8, 8)).transpose(2, 3)
    with pytest.raises(ValueError, match="contiguous pages"):
        copy_pages(src, torch.zeros((2, 4, 8, 8)), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("kwargs", [{"chunk_elements": 3000}, {"programs_per_sm": 0}, {"num_warps": 0}])
def test_bad_copy_configs_are_refused(kwargs):
    with pytest.raises(ValueError):
        CopyConfig(**kwargs)
