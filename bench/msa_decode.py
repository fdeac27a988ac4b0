"""MSA decode on one GPU, per layer: index scoring + top-k, sparse attention, the whole layer, and the
dense FlashInfer paged decode of the same context and batch (the peer), with M3 attention dims.

    python -m bench.msa_decode [--out DIR] [--contexts 8192,1048576] [--batches 1,8] [--no-sweep]
    python -m bench.msa_decode --table bench/results/msa_decode.json   # the README tables, no GPU needed

Every timing is a CUDA graph of the layer call(s), replayed and timed with CUDA events (median), so
launch gaps do not count (decode runs under CUDA graphs in production).  Each case keeps as many
independent layer caches as it takes for one replay to stream >= 256 MiB, and the graph walks
them in turn, so the timed data never sits in the 50 MiB L2.  Rows (``bench/results/msa_decode.json``):

* ``index_us``: indexer scan + merge (``decode_index_topk``), default ``ScanConfig``; ``scan_us`` and
  ``merge_us`` separately; ``index_scan_tbps``: k-index bytes / ``index_us``;
* ``attn_us``: sparse attention over the selected pages (FlashInfer flattened decode);
  ``attn_triton_us``: the Triton fallback;
* ``total_us``: ``GpuAttentionBackend.sparse`` (store + index + attention: the whole MSA layer);
* ``dense_us``: ``GpuAttentionBackend.dense`` (store + FlashInfer paged decode); ``speedup``;
* ``index_fp8_us``, ``total_fp8_us``, ``speedup_fp8``: the same over an fp8 (e4m3) k-index.

Then, with the time left, a sweep of scan configurations (pages per step, warps, stages, splits;
bf16 and fp8 keys) at 1M and 128K context goes to ``scan_sweep``.  Every case catches its own
failure; the JSON is rewritten after each case.
"""

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import markdown_table, write_results
from m3stack.engine.attention.gpu import GpuAttentionBackend
from m3stack.engine.attention.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import KVCacheSpec, LayerKVCache, allocate_kv_cache
from m3stack.engine.msa import reference
from m3stack.engine.msa.decode_attention import FlashInferSparseDecode, flashinfer_available, sparse_decode_attention
from m3stack.engine.msa.decode_index import ScanConfig, decode_index_topk, merge_selection, scan_index_pages
from m3stack.engine.msa.decode_plan import SparseDecodePlan, SparseDecodeShape, plan_sparse_decode
from m3stack.engine.msa.store import store_kv

logger = logging.getLogger("bench.msa_decode")

M3 = SparseDecodeShape(num_q_heads=64, num_kv_heads=4, head_dim=128, index_head_dim=128, block_size=128, topk=16,
                       local_blocks=1)  # fmt: skip
CONTEXTS = [8192, 32768, 131072, 524288, 1048576]
BATCHES = [1, 8, 32]
ROTATION_BYTES = 256 * 2**20
MAX_LAYERS = 64
TIME_BUDGET_S = 360  # bench/gpu_suite.py gives this stage 420 s
ROWS_BUDGET_S = 240  # the main rows first; the sweeps get the rest
SWEEP_CASES = {(1048576, 1), (131072, 8)}
SWEEP_CONFIGS = [ScanConfig(p, w, s) for p in (1, 2) for w in (4, 8) for s in (2, 3, 4)]
SWEEP_SPLITS = [64, 132, 264, 396, 512]
SWEEP_FP8_CONFIGS = [ScanConfig(1, 4, 3), ScanConfig(1, 8, 3), ScanConfig(2, 8, 3), ScanConfig(2, 4, 2)]
COLUMNS = ["context", "batch", "index_us", "scan_us", "merge_us", "attn_us", "attn_triton_us", "total_us",
           "dense_us", "speedup", "index_scan_tbps", "index_fp8_us", "total_fp8_us", "speedup_fp8"]  # fmt: skip


def time_layers(call: Callable[[int], Any], layers: int, replays: int = 15) -> tuple[float, str]:
    """Median microseconds per layer of ``call(0..layers-1)``, as a CUDA graph (eager if capture fails)."""
    for layer in range(layers):  # compile, plan caches, allocator warm-up
        call(layer)
    torch.cuda.synchronize()
    graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
    method = "cuda_graph"
    try:
        with torch.cuda.graph(graph):
            for layer in range(layers):
                call(layer)
    except Exception as exc:  # a path that cannot be captured is still timed, eagerly
        logger.warning("graph capture failed (%s); timing eagerly", exc)
        graph, method = None, "eager"
        torch.cuda.synchronize()

    def run() -> None:
        if graph is not None:
            graph.replay()
        else:
            for layer in range(layers):
                call(layer)

    run()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / layers)
    return statistics.median(samples), method


@dataclass
class Case:
    context: int
    batch: int
    caches: list[LayerKVCache]
    metadata: AttentionMetadata
    q: torch.Tensor  # [B, Hq, D]
    k_new: torch.Tensor  # [B, Hkv, D]
    index_q: torch.Tensor  # [B, Hidx, d]
    index_k_new: torch.Tensor  # [B, d]

    @property
    def layers(self) -> int:
        return len(self.caches)

    @property
    def index_bytes(self) -> int:
        return self.batch * self.context * M3.index_head_dim * 2


def case_layers(context: int, batch: int, free_bytes: int) -> tuple[int, int]:
    """(layers, pages per layer) that rotate >= ROTATION_BYTES of k-index and fit in ``free_bytes``."""
    pages = batch * math.ceil(context / M3.block_size) + 1  # page 0 stays unused
    index_page = M3.block_size * M3.index_head_dim * 2
    page_bytes = 2 * M3.num_kv_heads * M3.block_size * M3.head_dim * 2 + index_page
    layers = min(MAX_LAYERS, max(1, math.ceil(ROTATION_BYTES / (pages * index_page))))
    layers = min(layers, free_bytes // (pages * page_bytes))
    return layers, pages


def build_case(context: int, batch: int, device: torch.device, generator: torch.Generator) -> Case | str:
    free, _ = torch.cuda.mem_get_info(device)
    layers, pages = case_layers(context, batch, int(free * 0.8) - 2 * 2**30)
    if layers < 1:
        return f"needs more than the {free / 2**30:.0f} GiB free"
    spec = KVCacheSpec(num_layers=layers, num_kv_heads=M3.num_kv_heads, head_dim=M3.head_dim,
                       block_size=M3.block_size, index_head_dim=M3.index_head_dim, sparse_layers=(True,) * layers,
                       dtype=torch.bfloat16)  # fmt: skip
    caches = allocate_kv_cache(spec, pages, device)
    for cache in caches:
        for tensor in (cache.key, cache.value, cache.index_key):
            tensor.normal_(generator=generator)
    per_request = math.ceil(context / M3.block_size)
    page_table = (torch.randperm(pages - 1, generator=generator, device=device) + 1).view(batch, per_request)
    position = context - 1
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
    metadata = AttentionMetadata(
        block_size=M3.block_size,
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        positions=torch.full((batch,), position, dtype=torch.int64, device=device),
        slot_mapping=(page_table[:, position // M3.block_size] * M3.block_size + position % M3.block_size).long(),
        page_table=page_table.to(torch.int32),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)

    return Case(context, batch, caches, metadata, randn(batch, M3.num_q_heads, M3.head_dim),
                randn(batch, M3.num_kv_heads, M3.head_dim), randn(batch, M3.num_kv_heads, M3.index_head_dim),
                randn(batch, M3.index_head_dim))  # fmt: skip


def check_request0(case: Case, selected: torch.Tensor, out: torch.Tensor) -> dict[str, Any]:
    """The timed path's answer for request 0 against the fp32 reference (cheap up to ~128K)."""
    cache, context = case.caches[-1], case.context
    pages = case.metadata.page_table[0, : math.ceil(context / M3.block_size)].long()
    index_keys = cache.index_key[pages].flatten(0, 1)[:context]
    keys = cache.key[pages].transpose(1, 2).flatten(0, 1)[:context]
    values = cache.value[pages].transpose(1, 2).flatten(0, 1)[:context]
    positions = case.metadata.positions[:1]
    want = reference.index_block_topk(case.index_q[:1], index_keys, positions, M3.block_size, M3.topk, 1)
    same = [
        {b for b in got.tolist() if b >= 0} == {b for b in ref.tolist() if b >= 0}
        for got, ref in zip(selected[:, 0], want[:, 0], strict=True)
    ]
    attended = reference.sparse_attention(case.q[:1], keys, values, positions, selected[:, :1], M3.block_size,
                                          M3.head_dim**-0.5)  # fmt: skip
    return {"heads_same_selection": sum(same), "max_abs_err": float((out[:1].float() - attended).abs().max())}


def measure(case: Case, use_flashinfer: bool) -> dict[str, Any]:
    device = case.q.device
    scale = M3.head_dim**-0.5
    metadata, layers = case.metadata, case.layers
    row: dict[str, Any] = {"context": case.context, "batch": case.batch, "layers": layers}
    # The dense peer reads the same K/V tensors, as dense layers (no index keys).
    dense_views = [LayerKVCache(cache.key, cache.value, None) for cache in case.caches]
    backend, dense_backend = (
        GpuAttentionBackend(caches, topk_blocks=M3.topk, local_blocks=M3.local_blocks, num_q_heads=M3.num_q_heads,
                            use_flashinfer=use_flashinfer)
        for caches in (case.caches, dense_views)
    )  # fmt: skip
    backend.begin_step(metadata)
    dense_backend.begin_step(metadata)
    plan = plan_sparse_decode(metadata, M3, device)
    fi_sparse = None
    if use_flashinfer:
        fi_sparse = FlashInferSparseDecode(device)
        fi_sparse.plan(plan, torch.bfloat16, scale)
    caches = case.caches

    def timed(name: str, call: Callable[[int], Any]) -> None:
        row[name], method = time_layers(call, layers)
        if method != "cuda_graph":
            row.setdefault("timed_eagerly", []).append(name)

    timed("index_us", lambda layer: decode_index_topk(case.index_q, caches[layer].index_key, metadata, plan))
    partial = scan_index_pages(case.index_q, caches[0].index_key, metadata, plan)
    timed("scan_us", lambda layer: scan_index_pages(case.index_q, caches[layer].index_key, metadata, plan))
    timed("merge_us", lambda _l: merge_selection(partial, metadata, plan))
    row["index_scan_tbps"] = case.index_bytes / (row["index_us"] * 1e-6) / 1e12

    def attention(layer: int, fi: FlashInferSparseDecode | None) -> torch.Tensor:
        cache = caches[layer]
        return sparse_decode_attention(case.q, cache.key, cache.value, plan, metadata.positions, metadata.page_table,
                                       scale, fi)  # fmt: skip

    if fi_sparse is not None:
        timed("attn_us", lambda layer: attention(layer, fi_sparse))
    timed("attn_triton_us", lambda layer: attention(layer, None))
    args = (case.q, case.k_new, case.k_new, case.index_q, case.index_k_new)
    timed("total_us", lambda layer: backend.sparse(layer, *args))
    timed("dense_us", lambda layer: dense_backend.dense(layer, *args[:3]))
    row["speedup"] = row["dense_us"] / row["total_us"]

    # The same layer over an fp8 (e4m3) k-index: half the scan's bytes.
    fp8_caches = [LayerKVCache(c.key, c.value, c.index_key.to(torch.float8_e4m3fn)) for c in caches]
    timed("index_fp8_us", lambda layer: decode_index_topk(case.index_q, fp8_caches[layer].index_key, metadata, plan))

    def fp8_layer(layer: int) -> torch.Tensor:
        cache = fp8_caches[layer]
        store_kv(cache, metadata.slot_mapping, case.k_new, case.k_new, case.index_k_new)
        decode_index_topk(case.index_q, cache.index_key, metadata, plan)
        return attention(layer, fi_sparse)

    timed("total_fp8_us", fp8_layer)
    row["index_fp8_tbps"] = case.index_bytes / 2 / (row["index_fp8_us"] * 1e-6) / 1e12
    row["speedup_fp8"] = row["dense_us"] / row["total_fp8_us"]
    if case.context <= 131072:
        selected = decode_index_topk(case.index_q, caches[-1].index_key, metadata, plan)
        row.update(check_request0(case, selected, attention(layers - 1, fi_sparse)))
    return row


def sweep(case: Case, deadline: float) -> list[dict[str, Any]]:
    """Index time per scan configuration and split count at one case, bf16 and fp8 k-index."""
    device = case.q.device
    results = []
    variants = [(torch.bfloat16, config, None) for config in SWEEP_CONFIGS]
    variants += [(torch.bfloat16, ScanConfig(), splits) for splits in SWEEP_SPLITS if case.batch * splits <= 4096]
    variants += [(torch.float8_e4m3fn, config, None) for config in SWEEP_FP8_CONFIGS]
    index_caches = {torch.bfloat16: [cache.index_key for cache in case.caches]}
    for dtype, config, splits in variants:
        entry: dict[str, Any] = {"context": case.context, "batch": case.batch, "index_dtype": str(dtype)[6:],
                                 **config.__dict__, "scan_splits": splits}  # fmt: skip
        if time.monotonic() > deadline:
            entry["skipped"] = "time budget"
            results.append(entry)
            continue
        try:
            if dtype not in index_caches:
                index_caches[dtype] = [keys.to(dtype) for keys in index_caches[torch.bfloat16]]
            plan: SparseDecodePlan = plan_sparse_decode(case.metadata, M3, device, scan_splits=splits)
            entry["scan_splits"] = plan.scan_splits
            keys = index_caches[dtype]
            us, _ = time_layers(lambda layer, p=plan, c=config, k=keys: decode_index_topk(
                case.index_q, k[layer], case.metadata, p, c), case.layers)  # fmt: skip
            entry.update(index_us=us, index_scan_tbps=case.index_bytes * dtype.itemsize / 2 / (us * 1e-6) / 1e12)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        results.append(entry)
        logger.info("sweep %s", entry)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--table", type=Path, default=None, help="print the tables of a results file and exit")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.table is not None:
        payload = json.loads(args.table.read_text())
        print_tables(payload["rows"], payload.get("scan_sweep", []))
        return 0
    rows: list[dict[str, Any]] = []
    sweeps: list[dict[str, Any]] = []
    extra: dict[str, Any] = {"shape": M3.__dict__, "scan_config": ScanConfig().__dict__, "scan_sweep": sweeps}
    if not torch.cuda.is_available():
        write_results("msa_decode", [{"error": "no CUDA device"}], extra, args.out)
        return 1
    device = torch.device("cuda")
    use_flashinfer = flashinfer_available(device)
    extra["flashinfer"] = use_flashinfer
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    # Most telling cases first, so a time-out still leaves them measured.
    cases = sorted(((c, b) for c in contexts for b in batches), key=lambda cb: (cb[1] > 8, -cb[0], cb[1]))
    started = time.monotonic()
    generator = torch.Generator(device=device).manual_seed(0)
    for context, batch in cases:
        row: dict[str, Any] = {"context": context, "batch": batch}
        if time.monotonic() - started > ROWS_BUDGET_S:
            rows.append({**row, "skipped": "time budget"})
            continue
        try:
            case = build_case(context, batch, device, generator)
            row = {**row, "skipped": case} if isinstance(case, str) else measure(case, use_flashinfer)
        except Exception as exc:
            logger.exception("case context=%d batch=%d failed", context, batch)
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            case = None
            torch.cuda.empty_cache()
        rows.append(row)
        logger.info("%s", row)
        write_results("msa_decode", sorted(rows, key=lambda r: (r["context"], r["batch"])), extra, args.out)
    # Then the scan sweeps, with whatever time is left.
    for context, batch in [] if args.no_sweep else sorted(SWEEP_CASES, reverse=True):
        try:
            case = build_case(context, batch, device, generator)
            if not isinstance(case, str):
                sweeps.extend(sweep(case, started + TIME_BUDGET_S))
        except Exception as exc:
            logger.exception("sweep context=%d batch=%d failed", context, batch)
            sweeps.append({"context": context, "batch": batch, "error": f"{type(exc).__name__}: {exc}"[:500]})
        finally:
            case = None
            torch.cuda.empty_cache()
        write_results("msa_decode", sorted(rows, key=lambda r: (r["context"], r["batch"])), extra, args.out)
    rows.sort(key=lambda r: (r["context"], r["batch"]))
    write_results("msa_decode", rows, extra, args.out)
    print_tables(rows, sweeps)
    return 0


def print_tables(rows: list[dict[str, Any]], sweeps: list[dict[str, Any]]) -> None:
    """The results table (and the sweep, fastest first per case), last: the GPU run's reply shows the tail."""
    tables = [markdown_table(rows, COLUMNS)]

    def fastest_first(entry: dict[str, Any]) -> tuple:
        return entry["context"], entry["batch"], entry["index_dtype"], entry["index_us"]

    best = sorted((s for s in sweeps if "index_us" in s), key=fastest_first)
    if best:
        tables.append(markdown_table(best, ["context", "batch", "index_dtype", "pages_per_iteration", "num_warps",
                                            "num_stages", "scan_splits", "index_us", "index_scan_tbps"]))  # fmt: skip
    sys.stdout.write("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
