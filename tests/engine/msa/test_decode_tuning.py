"""Which scan a decode batch gets from ``DecodeTuning``."""

import pytest

from m3stack.engine.msa.decode_index import ScanConfig
from m3stack.engine.msa.decode_tuning import DecodeTuning


def test_one_request_merges_in_its_own_launch_and_batches_keep_the_configured_scan() -> None:
    tuning = DecodeTuning()
    assert tuning.scan_for(8, fp8_index=False) == tuning.scan
    assert tuning.scan_for(8, fp8_index=True) == tuning.fp8_scan
    one = tuning.scan_for(1, fp8_index=True)
    assert (one.fused_merge, one.merge_warps, one.num_stages) == (False, 1, tuning.fp8_scan.num_stages)
    explicit = DecodeTuning(scan=ScanConfig(page_ids_ahead=True), single_request_merge_warps=None)
    assert explicit.scan_for(1, fp8_index=False) == ScanConfig(page_ids_ahead=True)


def test_batches_from_two_requests_leave_the_merge_to_the_attention() -> None:
    tuning = DecodeTuning()
    assert not tuning.selects_in_attention(1) and tuning.selects_in_attention(2) and tuning.selects_in_attention(64)
    assert not DecodeTuning(select_in_attention_min_requests=None).selects_in_attention(64)
    assert tuning.scan_for(8, fp8_index=True, unmerged=True) == ScanConfig(num_stages=2, fused_merge=False)


def test_a_merge_warp_count_the_kernel_cannot_run_is_refused() -> None:
    with pytest.raises(ValueError, match="merge_warps must be"):
        DecodeTuning(single_request_merge_warps=3)
