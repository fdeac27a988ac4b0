"""How bench.msa_decode turns its sweep into the tuned layer: the variant names it records name a launch again."""

import dataclasses

from bench.msa_decode import (
    AHEAD_CONFIGS,
    FP8_AHEAD_CONFIGS,
    FP8_SCAN_PARTS,
    MERGE_CONFIGS,
    SCAN_CONFIGS,
    SPLIT_MAJOR,
    fastest_scan,
    scan_name,
)
from m3stack.engine.msa.decode_index import ScanConfig
from m3stack.engine.msa.decode_tuning import DecodeTuning

DEFAULTS = DecodeTuning()


def _row(part: str, variant: str, us: float | None) -> dict:
    return {"part": part, "variant": variant, **({"us": us} if us is not None else {"error": "skipped"})}


def test_the_fastest_bf16_index_variant_wins_whatever_part_recorded_it():
    ahead, programs = AHEAD_CONFIGS[0]
    rows = [
        _row("index", "programs_per_sm=3 splits=396", 76.0),
        _row("index", scan_name(SCAN_CONFIGS[2]), 75.0),
        _row("index_ahead", f"programs_per_sm={programs} splits=264 {scan_name(ahead)}", 60.0),
        _row("index_fp8_ahead", f"programs_per_sm=3 splits=396 {scan_name(ahead)}", 40.0),  # fp8: not a bf16 choice
        _row("index_ahead", f"programs_per_sm=1 splits=132 {scan_name(AHEAD_CONFIGS[2][0])}", None),  # untimed
    ]
    assert fastest_scan(rows, DEFAULTS) == (programs, ahead)
    assert fastest_scan(rows[:2], DEFAULTS) == (DEFAULTS.scan_programs_per_sm, SCAN_CONFIGS[2])
    only_programs = [_row("index", "programs_per_sm=2 splits=264", 70.0)]  # the default scan config
    assert fastest_scan(only_programs, DEFAULTS) == (2, ScanConfig())  # the scan's default launch, merge fused
    assert fastest_scan([], DEFAULTS) == (DEFAULTS.scan_programs_per_sm, DEFAULTS.scan)


def test_fp8_picks_among_its_own_parts_and_a_faster_separate_merge_applies_to_both():
    fp8_ahead, fp8_programs = FP8_AHEAD_CONFIGS[0]
    fused, one_warp = MERGE_CONFIGS[:2]
    rows = [
        _row("index", scan_name(SCAN_CONFIGS[2]), 75.0),
        _row("index_merge", scan_name(fused), 76.0),
        _row("index_fp8", scan_name(SCAN_CONFIGS[1]), 72.0),
        _row("index_fp8_ahead", f"programs_per_sm={fp8_programs} splits=396 {scan_name(fp8_ahead)}", 45.0),
    ]
    assert fastest_scan(rows, DEFAULTS, FP8_SCAN_PARTS) == (fp8_programs, fp8_ahead)
    slower_merge = [*rows, _row("index_merge", scan_name(one_warp), 77.0)]
    assert fastest_scan(slower_merge, DEFAULTS) == (DEFAULTS.scan_programs_per_sm, SCAN_CONFIGS[2])
    faster_merge = [*rows, _row("index_merge", scan_name(one_warp), 70.0)]
    separate = {"fused_merge": False, "merge_warps": one_warp.merge_warps}
    bf16_pick = (DEFAULTS.scan_programs_per_sm, dataclasses.replace(SCAN_CONFIGS[2], **separate))
    assert fastest_scan(faster_merge, DEFAULTS) == bf16_pick
    assert fastest_scan(faster_merge, DEFAULTS, FP8_SCAN_PARTS) == (
        fp8_programs,
        dataclasses.replace(fp8_ahead, **separate),
    )


def test_every_swept_scan_config_has_its_own_name():
    configs = set(SCAN_CONFIGS + [config for config, _ in AHEAD_CONFIGS + FP8_AHEAD_CONFIGS] + MERGE_CONFIGS)
    configs.add(SPLIT_MAJOR)
    assert len({scan_name(c) for c in configs}) == len(configs)
