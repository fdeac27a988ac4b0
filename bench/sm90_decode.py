"""Compile the MSA decode Triton kernels for sm_90 ahead of time (no GPU needed): registers, spills,
shared memory, resident CTAs per SM, wgmma/cp.async counts, and whether the one-launch merge and
combine compiled to the atomics they rely on, for every launch config ``bench.msa_decode`` sweeps.

    PYTHONPATH=/tmp/triton36:$PWD python -m bench.sm90_decode [--dump DIR] [--out DIR]

Same method and Triton-version caveat as ``bench.sm90_compile`` (use Triton 3.6, the H200's).
"""

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path

from bench.sm90_compile import TRITON_DEFAULT_STAGES, KernelBuild, report_builds


def decode_builds() -> Iterator[KernelBuild]:
    """The decode indexer (scan with the fused merge and store, separate merge), the sparse decode attention and
    the attention that merges the scan's lists itself at M3 dims, in the launch configs ``bench.msa_decode`` uses
    and sweeps, with programmatic dependent launch as the engine launches them on sm_90."""
    import triton

    from bench import msa_decode as bench
    from m3stack.engine.msa import decode_fused, decode_index, decode_index_kernels, paged_attention

    shape = bench.M3
    ranked = shape.topk - shape.local_blocks
    merge = dict(
        HIDX=shape.num_kv_heads, B=shape.block_size, CS=shape.num_kv_heads, KP=triton.next_power_of_2(ranked),
        TOPK=shape.topk, TOPK_P=shape.topk, KR=ranked, KR_P=triton.next_power_of_2(ranked), LOCAL=shape.local_blocks,
        FLOOR=decode_index_kernels.FLOOR,
    )  # fmt: skip
    store = dict(ST_HKV=shape.num_kv_heads, ST_HKV_P=shape.num_kv_heads, ST_D=shape.head_dim, ST_D_P=shape.head_dim,
                 ST_DI=shape.index_head_dim, ST_DI_P=shape.index_head_dim, ST_HAS_INDEX=True)  # fmt: skip
    for key_type in ("*bf16", "*fp8e4nv"):
        # The engine's fp8 k-index has a float32 scale per token; a bf16 one passes stand-ins of its own types.
        scaled = key_type == "*fp8e4nv"
        scale_type = "*fp32" if scaled else "*bf16"
        pointers = dict(
            q_ptr="*bf16", key_ptr=key_type, page_table_ptr="*i32", query_start_ptr="*i32", seq_lens_ptr="*i32",
            list_ptr="*i64", head_ptr="*i64", counter_ptr="*i32", row_indptr_ptr="*i32", selected_ptr="*i32",
            page_ids_ptr="*i32", slot_ptr="*i64", k_ptr="*bf16", v_ptr="*bf16", ik_ptr="*bf16",
            key_cache_ptr="*bf16", value_cache_ptr="*bf16", index_cache_ptr=key_type, key_scale_ptr=scale_type,
            index_scale_ptr=scale_type,
        )  # fmt: skip
        if key_type == "*bf16":
            configs = bench.SCAN_CONFIGS + [config for config, _ in bench.AHEAD_CONFIGS]
        else:
            configs = bench.SCAN_CONFIGS[:2] + [config for config, _ in bench.FP8_AHEAD_CONFIGS]
        for config in configs:
            for splits_padded in (512, 128):
                yield KernelBuild(
                    f"scan {key_type[1:]} {bench.scan_name(config)} sp={splits_padded}",
                    decode_index_kernels.scan_kernel, pointers,
                    dict(D=shape.index_head_dim, N=16, SP=splits_padded, PAGES=config.pages_per_iteration,
                         PAGE_IDS_AHEAD=config.page_ids_ahead, INPUT_PRECISION="tf32",
                         MERGE=True, PDL=config.pdl, KEY_SCALED=scaled, ST_INDEX_SCALED=scaled, **merge, **store),
                    config.num_warps, config.num_stages,
                )  # fmt: skip
    # The shared-page scan (bf16 keys, as the engine's option runs it) at groups of 4 and 16 requests.
    shared_pointers = {name: pointers[name] for name in ("q_ptr", "page_table_ptr", "query_start_ptr", "seq_lens_ptr",
                                                         "list_ptr", "head_ptr", "slot_ptr", "k_ptr", "v_ptr",
                                                         "ik_ptr", "key_cache_ptr", "value_cache_ptr")}  # fmt: skip
    shared_pointers.update(key_ptr="*bf16", index_cache_ptr="*bf16", key_scale_ptr="*bf16", index_scale_ptr="*bf16")
    for config in bench.SHARED_PAGES:
        columns = max(16, shape.num_kv_heads * config.shared_group)
        yield KernelBuild(
            f"shared-page scan bf16 {bench.scan_name(config)}", decode_index_kernels.shared_scan_kernel,
            shared_pointers,
            dict(HIDX=shape.num_kv_heads, D=shape.index_head_dim, B=shape.block_size, N=columns,
                 CS=shape.num_kv_heads, KP=merge["KP"], GROUP=config.shared_group, LOCAL=shape.local_blocks,
                 PAGES=config.pages_per_iteration, PAGE_IDS_AHEAD=config.page_ids_ahead,
                 SPLIT_MAJOR=config.split_major, INPUT_PRECISION="tf32", CHUNK=decode_index._PAGE_COMPARE_CHUNK,
                 PDL=config.pdl, KEY_SCALED=False, ST_INDEX_SCALED=False, **store),
            config.num_warps, config.num_stages,
        )  # fmt: skip
    merge_pointers = dict(list_ptr="*i64", head_ptr="*i64", page_table_ptr="*i32", query_start_ptr="*i32",
                          seq_lens_ptr="*i32", row_indptr_ptr="*i32", selected_ptr="*i32",
                          page_ids_ptr="*i32")  # fmt: skip
    for splits_padded in (512, 128):
        for warps in (4, 1):
            columns = max(1, min(shape.num_kv_heads, decode_index._MERGE_KEYS_PER_WARP * warps // splits_padded))
            yield KernelBuild(
                f"merge sp={splits_padded} columns={columns}", decode_index_kernels.merge_kernel, merge_pointers,
                dict(SP=splits_padded, CPB=columns, PDL=True, **merge), warps, TRITON_DEFAULT_STAGES,
            )  # fmt: skip
    attention_pointers = dict(
        q_ptr="*bf16", key_ptr="*bf16", value_ptr="*bf16", out_ptr="*bf16", partial_o_ptr="*fp32",
        partial_lse_ptr="*fp32", token_request_ptr="*i32", positions_ptr="*i64", page_table_ptr="*i32",
        row_indptr_ptr="*i32", page_ids_ptr="*i32", last_len_ptr="*i32", counter_ptr="*i32",
    )  # fmt: skip
    group = shape.num_q_heads // shape.num_kv_heads
    for config in bench.ATTENTION_CONFIGS:
        yield KernelBuild(
            f"attention pages/split={config.pages_per_split} combine={config.fused_combine}",
            paged_attention._attention_kernel, attention_pointers,
            dict(HKV=shape.num_kv_heads, G=group, GP=max(16, group), D=shape.head_dim, B=shape.block_size,
                 DENSE=False, SPLIT=True, COMBINE=config.fused_combine, INPUT_PRECISION="tf32", PDL=config.pdl),
            config.num_warps, config.num_stages or TRITON_DEFAULT_STAGES, scalar_types={"scale_log2": "fp32"},
        )  # fmt: skip
    select_pointers = dict(
        q_ptr="*bf16", key_ptr="*bf16", value_ptr="*bf16", out_ptr="*bf16", partial_o_ptr="*fp32",
        partial_lse_ptr="*fp32", counter_ptr="*i32", list_ptr="*i64", head_ptr="*i64", page_table_ptr="*i32",
        query_start_ptr="*i32", seq_lens_ptr="*i32", token_request_ptr="*i32", row_indptr_ptr="*i32",
        last_len_ptr="*i32", selected_ptr="*i32", page_ids_ptr="*i32",
    )  # fmt: skip
    for splits_padded in (512, 128):
        yield KernelBuild(
            f"attention merging the lists sp={splits_padded}", decode_fused._select_attend_kernel, select_pointers,
            dict(G=group, GP=max(16, group), D=shape.head_dim, SPLIT=True, PDL=True, INPUT_PRECISION="tf32",
                 SP=splits_padded, **merge),
            4, TRITON_DEFAULT_STAGES, scalar_types={"scale_log2": "fp32"},
        )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, default=None, help="write each build's TTGIR and PTX here")
    parser.add_argument("--out", type=Path, default=None, help="also write sm90_decode.json here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report_builds("sm90_decode", decode_builds(), args.dump, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
