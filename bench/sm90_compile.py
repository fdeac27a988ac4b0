"""Compile the MSA prefill and decode and the MXFP8 Triton kernels for sm_90 ahead of time (no GPU needed) and
report what an H200 would run: registers, spill bytes, shared memory, resident CTAs per SM, wgmma and cp.async counts.

    python -m bench.sm90_compile                      # every launch config the prefill benchmark sweeps
    python -m bench.sm90_compile --kernels block_major --dump /tmp/ttgir   # also write TTGIR and PTX
    python -m bench.sm90_compile --kernels mxfp8      # the MXFP8 matmuls' tile classes

Use the Triton version of the GPU machine (3.6 on the H200, ``../shared/gpu/README.md``): code
generation, register allocation and software pipelining change between versions.  For example
``pip install --target /tmp/triton36 triton==3.6.0`` once, then run this module with
``PYTHONPATH=/tmp/triton36:$PWD`` and the project environment's Python.  A config that spills
(``spill_bytes`` > 0) or fits one CTA per SM where two were meant shows here before any GPU time is
spent; ``--dump`` shows where the software pipeliner put each load and wait.  Prints a markdown
table; ``--out`` also writes ``sm90_compile.json``.
"""

import argparse
import dataclasses
import itertools
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.common import markdown_table, write_results

logger = logging.getLogger("bench.sm90_compile")

# Per-SM limits of sm_90 (H100/H200): registers, shared memory for CTAs, threads, CTAs.
SM90_REGISTERS = 65536
SM90_SHARED_BYTES = 228 * 1024
SM90_SHARED_PER_CTA_RESERVED = 1024
SM90_THREADS = 2048
SM90_CTAS = 32
TRITON_DEFAULT_STAGES = 3  # what a launch without num_stages compiles with


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """One kernel specialisation: the Triton function, its argument types and constexprs, launch options."""

    name: str
    kernel: Any  # triton JITFunction
    pointer_types: dict[str, str]  # pointer argument -> Triton type ("*bf16"); other arguments are i32
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    scalar_types: dict[str, str] = dataclasses.field(default_factory=dict)  # non-i32 scalars ("fp32")


def _signature(build: KernelBuild) -> tuple[dict[str, str], dict[tuple[int], list]]:
    signature, attrs = {}, {}
    for index, arg in enumerate(build.kernel.arg_names):
        if arg in build.constexprs:
            signature[arg] = "constexpr"
            continue
        if arg.endswith("_ptr"):
            signature[arg] = build.pointer_types[arg]
        else:
            signature[arg] = build.scalar_types.get(arg, "i32")
        if arg.endswith("_ptr") or arg.startswith("stride"):
            attrs[(index,)] = [["tt.divisibility", 16]]  # as the launcher specialises aligned tensors
    return signature, attrs


def _resource_usage(cubin: bytes) -> dict[str, int]:
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run(
            [str(tools / "cuobjdump"), "-res-usage", handle.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if not found:
        raise RuntimeError(f"no resource usage in cuobjdump output:\n{text}")
    return dict(zip(("registers", "stack", "static_shared", "local"), map(int, found.groups()), strict=True))


def ctas_per_sm(registers: int, shared_bytes: int, num_warps: int) -> int:
    """Resident CTAs per SM as the occupancy calculator counts them (registers in warp units of 256)."""
    threads = 32 * num_warps
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM90_REGISTERS // (regs_per_warp * num_warps)
    by_shared = SM90_SHARED_BYTES // (shared_bytes + SM90_SHARED_PER_CTA_RESERVED)
    return min(by_registers, by_shared, SM90_THREADS // threads, SM90_CTAS)


def compile_report(build: KernelBuild, dump_dir: Path | None = None) -> dict[str, Any]:
    """Compile ``build`` for sm_90 and describe the result (or the compile error)."""
    row: dict[str, Any] = {"kernel": build.name, "warps": build.num_warps, "stages": build.num_stages}
    signature, attrs = _signature(build)
    source = ASTSource(fn=build.kernel, signature=signature, constexprs=build.constexprs, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": build.num_warps, "num_stages": build.num_stages})
    try:
        compiled = triton.compile(source, target=target, options=options.__dict__)
    except Exception as error:  # one failing config must not hide the others
        row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
        return row
    usage = _resource_usage(compiled.asm["cubin"])
    shared = compiled.metadata.shared
    ptx = compiled.asm["ptx"]
    row.update(
        registers=usage["registers"],
        spill_bytes=usage["stack"] + usage["local"],
        shared_kib=round(shared / 1024, 1),
        ctas_per_sm=ctas_per_sm(usage["registers"], shared, build.num_warps),
        wgmma=ptx.count("wgmma.mma_async"),
        mma_sync=ptx.count("mma.sync"),
        cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
    )
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{build.name}_w{build.num_warps}_s{build.num_stages}")
        (dump_dir / f"{stem}.ttgir").write_text(compiled.asm["ttgir"])
        (dump_dir / f"{stem}.ptx").write_text(ptx)
    return row


def prefill_builds() -> Iterator[KernelBuild]:
    """The MSA prefill kernels at M3 dims (bf16), in every launch config ``bench.msa_prefill`` sweeps."""
    from bench import msa_prefill as bench
    from m3stack.engine.msa import prefill_block_major, prefill_csr, prefill_index, prefill_query_major

    heads, kv_heads, dim, block, topk = bench.Q_HEADS, bench.KV_HEADS, bench.HEAD_DIM, bench.BLOCK, bench.TOPK
    precision = dict(INPUT_PRECISION="tf32")
    index_pointers = dict(q_ptr="*bf16", key_ptr="*bf16", page_table_ptr="*i32", positions_ptr="*i64",
                          tile_ptr="*i32", out_ptr="*i32", cand_score_ptr="*fp32", cand_id_ptr="*i32")  # fmt: skip
    index_shape = dict(H=kv_heads, HP=kv_heads, B=block, K=topk, KP=topk, LOCAL=bench.LOCAL)
    for tuning in bench.INDEX_CONFIGS:
        launch = prefill_index.index_launch(tuning)
        for splits in (1, 4) if tuning == bench.INDEX_CONFIGS[0] else (1,):
            yield KernelBuild(
                f"index tile={tuning.tile_tokens} splits={splits}", prefill_index._index_topk_kernel, index_pointers,
                dict(D=bench.INDEX_DIM, DP=bench.INDEX_DIM, TILE=tuning.tile_tokens, SPLIT_KEYS=splits > 1,
                     **index_shape, **precision),
                **launch,
            )  # fmt: skip
    yield KernelBuild(
        "index_merge splits=4", prefill_index._index_topk_merge_kernel, index_pointers,
        dict(TILE=bench.INDEX_CONFIGS[0].tile_tokens, **index_shape), num_warps=8,
        num_stages=TRITON_DEFAULT_STAGES,
    )  # fmt: skip
    attention_pointers = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", positions_ptr="*i64", items_ptr="*i32",
                              entries_ptr="*i32", part_o_ptr="*bf16", part_lse_ptr="*fp32")  # fmt: skip
    dims = dict(HKV=kv_heads, G=heads // kv_heads, GP=heads // kv_heads, D=dim, DP=dim, B=block, K=topk)
    for tuning in bench.BLOCK_MAJOR_CONFIGS:
        launch = prefill_block_major.attention_launch(tuning)
        constexprs = dict(TILE=tuning.tile_tokens, PREFETCH=launch.pop("PREFETCH"), **dims, **precision)
        yield KernelBuild(
            f"block_major tile={tuning.tile_tokens} prefetch={constexprs['PREFETCH']}",
            prefill_block_major._block_major_kernel, attention_pointers, constexprs, **launch,
            scalar_types={"scale_log2": "fp32"},
        )  # fmt: skip
    merge_pointers = dict(part_o_ptr="*bf16", part_lse_ptr="*fp32", sel_ptr="*i32", positions_ptr="*i64",
                          out_ptr="*bf16")  # fmt: skip
    for warps, stages, tokens in bench.MERGE_CONFIGS:
        yield KernelBuild(
            f"merge merge_stages={stages} tokens={tokens}", prefill_block_major._merge_kernel, merge_pointers,
            dict(HKV=kv_heads, G=heads // kv_heads, GP=heads // kv_heads, D=dim, DP=dim, B=block, K=topk,
                 TOKENS=tokens, NUM_STAGES=stages),
            num_warps=warps, num_stages=TRITON_DEFAULT_STAGES,
        )  # fmt: skip
    yield KernelBuild(
        "query_major", prefill_query_major._query_major_kernel,
        dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", sel_ptr="*i32", positions_ptr="*i64",
             token_request_ptr="*i32", page_table_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*bf16"),
        dict(G=heads // kv_heads, GP=heads // kv_heads, D=dim, DP=dim, B=block, K=topk, **precision),
        num_warps=4, num_stages=2, scalar_types={"scale_log2": "fp32"},
    )  # fmt: skip
    bucket_pointers = dict(sel_ptr="*i32", positions_ptr="*i64", token_request_ptr="*i32",
                           request_first_block_ptr="*i32", counts_ptr="*i32", row_ptr_ptr="*i32", rank_ptr="*i32",
                           entries_ptr="*i32")  # fmt: skip
    for fill in (False, True):
        yield KernelBuild(
            f"csr_bucket fill={fill}", prefill_csr._bucket_pass_kernel, bucket_pointers,
            dict(K=topk, B=block, HKV=kv_heads, BLOCK=prefill_csr._ENTRIES_PER_PROGRAM, FILL=fill),
            num_warps=4, num_stages=TRITON_DEFAULT_STAGES,
        )  # fmt: skip
    yield KernelBuild(
        "csr_items", prefill_csr._items_kernel,
        dict(row_ptr_ptr="*i32", item_ptr_ptr="*i32", block_page_ptr="*i64", block_first_pos_ptr="*i32",
             block_num_keys_ptr="*i32", items_ptr="*i32"),
        dict(HKV=kv_heads, BLOCK=prefill_csr._BUCKETS_PER_PROGRAM), num_warps=4, num_stages=TRITON_DEFAULT_STAGES,
    )  # fmt: skip


def decode_builds() -> Iterator[KernelBuild]:
    """The MSA decode index scan at M3 dims (one token per request, merge and store fused), over a bf16 k-index in
    the scan configs ``bench.msa_decode`` sweeps (and with the page ids loaded one iteration ahead), and over the
    engine's fp8 k-index (e4m3 keys, a float32 scale per token) in ``DecodeTuning().fp8_scan`` and the one-page
    configs."""
    from bench import msa_decode as bench
    from m3stack.engine.msa import decode_index_kernels
    from m3stack.engine.msa.decode_tuning import DecodeTuning

    shape = bench.M3
    ranked = shape.topk - shape.local_blocks
    pointers = dict(q_ptr="*bf16", key_ptr="*bf16", key_scale_ptr="*fp32", page_table_ptr="*i32",
                    query_start_ptr="*i32", seq_lens_ptr="*i32", list_ptr="*i64", head_ptr="*i64", counter_ptr="*i32",
                    row_indptr_ptr="*i32", selected_ptr="*i32", page_ids_ptr="*i32", slot_ptr="*i64", k_ptr="*bf16",
                    v_ptr="*bf16", ik_ptr="*bf16", key_cache_ptr="*bf16", value_cache_ptr="*bf16",
                    index_cache_ptr="*bf16", index_scale_ptr="*fp32")  # fmt: skip
    fp8_pointers = dict(pointers, key_ptr="*fp8e4nv", index_cache_ptr="*fp8e4nv")
    constexprs = dict(
        HIDX=shape.num_kv_heads, D=shape.index_head_dim, B=shape.block_size, N=16, CS=shape.num_kv_heads,
        KP=triton.next_power_of_2(ranked), SP=512, TOPK=shape.topk, TOPK_P=triton.next_power_of_2(shape.topk),
        KR=ranked, KR_P=triton.next_power_of_2(ranked), LOCAL=shape.local_blocks, INPUT_PRECISION="tf32",
        MERGE=True, PDL=True, SPLIT_MAJOR=False, FLOOR=decode_index_kernels.FLOOR, ST_HKV=shape.num_kv_heads,
        ST_HKV_P=shape.num_kv_heads, ST_D=shape.head_dim, ST_D_P=shape.head_dim, ST_DI=shape.index_head_dim,
        ST_DI_P=shape.index_head_dim, ST_HAS_INDEX=True,
    )  # fmt: skip
    configs = [dataclasses.replace(c, page_ids_ahead=ahead) for ahead in (False, True) for c in bench.SCAN_CONFIGS]
    builds = [(config, "", pointers, False) for config in configs]
    fp8_configs = dict.fromkeys([DecodeTuning().fp8_scan, *bench.SCAN_CONFIGS[:4]])
    builds += [(config, " fp8-index", fp8_pointers, True) for config in fp8_configs]
    for config, label, types, scaled in builds:
        yield KernelBuild(
            f"scan pages={config.pages_per_iteration} ahead={config.page_ids_ahead}{label}",
            decode_index_kernels.scan_kernel, types,
            dict(PAGES=config.pages_per_iteration, PAGE_IDS_AHEAD=config.page_ids_ahead, KEY_SCALED=scaled,
                 ST_INDEX_SCALED=scaled, **constexprs),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip


def mxfp8_builds() -> Iterator[KernelBuild]:
    """The MXFP8 matmuls at M3's decode sizes: the GEMV, each MMA tile class of ``mxfp8_kernels``' plan, and the
    same tiles multiplying out.T = W x.T (``swap_ab``: the weights on the MMA's M side), bf16 activations."""
    from m3stack.engine.model import mxfp8_kernels as kernels

    pointers = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*u8", out_ptr="*bf16", partials_ptr="*fp32",
                    counters_ptr="*i32", ends_ptr="*i32")  # fmt: skip
    experts = dict(GROUPS=128, GROUPS_P=128, SPLIT=1, EVEN_K=True)
    dense = dict(GROUPS=0, GROUPS_P=1, SPLIT=4, EVEN_K=True)
    gemv = kernels.GROUPED_GEMV_TILES
    yield KernelBuild(
        "mxfp8 gemv experts",
        kernels._mxfp8_gemv_kernel,
        pointers,
        dict(BLOCK_N=gemv.block_n, BLOCK_K=gemv.block_k, **experts),
        gemv.num_warps,
        gemv.num_stages,
    )
    from bench.mxfp8_gemv import DENSE_MMAS, GROUPED_MMAS

    cases = [("experts decode", kernels.DECODE_TILES, experts), ("dense decode", kernels.DECODE_TILES, dense),
             ("experts medium", kernels.MEDIUM_TILES, experts), ("dense medium", kernels.DENSE_MEDIUM_TILES, dense),
             ("experts prefill", kernels.PREFILL_TILES, experts)]  # fmt: skip
    cases = [
        (name, replace(tiles, swap_ab=swap_ab), shape) for name, tiles, shape in cases for swap_ab in (False, True)
    ]
    # and the other swap_ab candidates bench.mxfp8_gemv times
    cases += [("experts", tiles, experts) for tiles in GROUPED_MMAS if tiles.swap_ab]
    cases += [("dense", tiles, dense) for tiles in DENSE_MMAS if tiles.swap_ab]
    seen = set()
    for name, tiles, shape in cases:
        if (tiles, shape["GROUPS"]) in seen:
            continue
        seen.add((tiles, shape["GROUPS"]))
        constexprs = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, WIDEN=tiles.widen,
                          SWAP_AB=tiles.swap_ab, **shape)  # fmt: skip
        label = (f"mxfp8 {name}{' swap_ab' if tiles.swap_ab else ''} {tiles.block_m}x{tiles.block_n}x{tiles.block_k}"
                 f" widen{tiles.widen}")  # fmt: skip
        yield KernelBuild(label, kernels._mxfp8_matmul_kernel, pointers, constexprs, tiles.num_warps,
                          tiles.num_stages)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kernels", default="index,index_merge,block_major,merge,query_major,csr_bucket,csr_items,scan,mxfp8"
    )
    parser.add_argument("--dump", type=Path, default=None, help="write each build's TTGIR and PTX here")
    parser.add_argument("--out", type=Path, default=None, help="also write sm90_compile.json here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    kernels = set(args.kernels.split(","))
    all_builds = itertools.chain(prefill_builds(), decode_builds(), mxfp8_builds())
    builds = (b for b in all_builds if b.name.split(" ")[0] in kernels)
    report_builds("sm90_compile", builds, args.dump, args.out)
    return 0


def report_builds(name: str, builds: Iterable[KernelBuild], dump: Path | None, out: Path | None) -> None:
    """Compile each build, log its row, write ``<name>.json`` under ``out`` (if given) and print the table."""
    rows = []
    for build in builds:
        rows.append(compile_report(build, dump))
        logger.info("%s", rows[-1])
    if out is not None:
        write_results(name, rows, {"triton": triton.__version__}, out_dir=out)
    columns = ["kernel", "warps", "stages", "registers", "spill_bytes", "shared_kib", "ctas_per_sm", "wgmma",
               "mma_sync", "cp_async", "error"]  # fmt: skip
    sys.stdout.write(f"Triton {triton.__version__}, sm_90\n\n{markdown_table(rows, columns)}\n")


if __name__ == "__main__":
    raise SystemExit(main())
