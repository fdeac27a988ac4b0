"""MSA decode on one GPU, per layer: index scoring + top-k, sparse attention, the whole layer, and the
dense FlashInfer paged decode of the same context and batch (the peer), with M3 attention dims; then
a sweep of the decode layer's launch choices (``engine.msa.decode_tuning``) and the layer re-timed
with the fastest of them, all in one run.

    python -m bench.msa_decode [--out DIR] [--contexts 8192,1048576] [--batches 1,8] [--no-sweep]
    python -m bench.msa_decode --table bench/results/msa_decode.json   # the README tables, no GPU needed

Timing: each measurement is a CUDA graph of many layer calls (the case's independent layer caches in
turn, repeated until one replay runs >= ~2 ms), replayed and timed with CUDA events (median of 10
replays, divided by the calls), as a decode step's graph runs layer after layer: launch gaps inside
the graph count, the graph's own launch does not.  The cases rotate enough layer caches that one
pass streams >= 256 MiB of k-index, so the timed data never sits in the 50 MiB L2.  ``*_1replay_us``
keep the method of earlier runs (one graph of one pass per replay, launch latency included).

Rows (``rows`` in the JSON, default ``DecodeTuning``):

* ``index_us``: ``decode_index_topk`` in the default launch (``DecodeTuning.scan_for`` the batch: the merge
  fused into the scan, at batch 1 in its own one-warp launch);
  ``scan_us``: the scan alone, and ``merge_us``: that merge alone; ``index_fused_us``: the scan with the
  merge fused into its last program per request; ``index_scan_tbps``: k-index bytes / ``index_us``;
* ``attn_us``: the Triton sparse attention over the selected pages; ``attn_fi_us``: FlashInfer's;
* ``total_us``: ``GpuAttentionBackend.sparse`` (store + index + attention: the whole MSA layer);
  ``total_fi_us``: the same with FlashInfer attention and a separate store;
* ``dense_us``: ``GpuAttentionBackend.dense`` (store + FlashInfer paged decode); ``speedup``;
* ``index_fp8_us``, ``total_fp8_us``, ``speedup_fp8``: the same layer over the engine's fp8 (e4m3, a scale per token)
  k-index; ``fp8_selection_overlap``: the share of selected blocks it keeps against the bf16 index;
* ``default_us``, ``no_pdl_us``, ``merge_launch_us``, ``select_us`` (and ``*_fp8_us``): the layer with each way of
  running what follows the scan (``VARIANTS``), ``best_*`` the fastest;
* ``peer_us``: the reference stack's decode layer (index + attention, no store) over the same inputs
  (``bench.msa_peer``, absent without ``.peer``), ``*_vs_peer`` = peer / ours; up to 128K its selection and output
  against ours (``peer_heads_same_selection``, ``peer_max_abs_diff``).

Then, at the sweep cases (1M and 128K, batch 1 and 8): scan programs per SM, scan launch configs,
fp8 scan configs, the merge fused or in its own launch, the split-major launch order and shared-page scans (at
batch > 1 also over page tables sharing one prefix), attention configs and FlashInfer, store fused or not
(``decode_sweep``), and the layer with the fastest index and attention choices (``tuned``).  Every case catches
its own failure and the JSON is rewritten after each; the tables print last.
"""

import argparse
import dataclasses
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

from bench import msa_peer
from bench.common import int_list, markdown_table, write_results
from m3stack.engine.attention.gpu import GpuAttentionBackend
from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import KVCacheSpec, LayerKVCache, allocate_kv_cache, fp8_index_from
from m3stack.engine.msa import reference
from m3stack.engine.msa.decode_attention import (
    FlashInferSparseDecode,
    TritonDecodeConfig,
    flashinfer_available,
    sparse_decode_attention,
)
from m3stack.engine.msa.decode_fused import select_and_attend
from m3stack.engine.msa.decode_index import ScanConfig, decode_index_topk, merge_selection, scan_index_pages
from m3stack.engine.msa.decode_plan import SparseDecodePlan, SparseDecodeShape, plan_sparse_decode
from m3stack.engine.msa.decode_tuning import DecodeTuning

logger = logging.getLogger("bench.msa_decode")

M3 = SparseDecodeShape(num_q_heads=64, num_kv_heads=4, head_dim=128, index_head_dim=128, block_size=128, topk=16,
                       local_blocks=1)  # fmt: skip
CONTEXTS = [8192, 32768, 131072, 524288, 1048576]
BATCHES = [1, 8, 32]
# Swept cases, most telling first: the 7x target is at 1M, batch 1 is the hardest.
SWEEP_CASES = [(1048576, 1), (131072, 1), (1048576, 8), (131072, 8)]
ROTATION_BYTES = 256 * 2**20
MAX_LAYERS = 64
TARGET_REPLAY_US = 2000.0
MAX_REPEATS = 64
TIME_BUDGET_S = 330  # bench/gpu_suite.py gives this stage 420 s
SWEEP_BUDGET_S = 90  # per swept case
SCAN_PROGRAMS_PER_SM = [1, 2, 3, 4]
SCAN_CONFIGS = [ScanConfig(p, w, s) for p, w, s in ((1, 4, 3), (1, 4, 2), (1, 4, 4), (1, 8, 3), (2, 4, 2), (2, 8, 2),
                                                    (2, 8, 3))]  # fmt: skip
# (scan config with page ids loaded ahead, programs per SM its shared memory allows)
AHEAD_CONFIGS = [
    (ScanConfig(1, 4, 3, page_ids_ahead=True), 2),
    (ScanConfig(1, 4, 2, page_ids_ahead=True), 3),
    (ScanConfig(1, 4, 4, page_ids_ahead=True), 1),
    (ScanConfig(1, 8, 3, page_ids_ahead=True), 2),
]
# The same for an fp8 k-index, whose tiles take half the shared memory: Triton's pipeliner stages an fp8 tile
# (widened before the dot) only with the page ids ahead, and keeps num_stages - 2 tiles in flight (bench.sm90_decode:
# 3 x 16 KiB buffers at 4 stages; without page ids ahead one buffer, waited for in the iteration that fills it).
FP8_AHEAD_CONFIGS = [
    (ScanConfig(1, 4, 4, page_ids_ahead=True), 3),
    (ScanConfig(1, 4, 5, page_ids_ahead=True), 3),
    (ScanConfig(1, 4, 4, page_ids_ahead=True), 2),
    (ScanConfig(1, 8, 4, page_ids_ahead=True), 2),
]
# Split-major launch order (the same split of every request side by side), timed on the case's own pages and on
# page tables where every request shares the first request's pages (one agentic prefix) but its last block
SPLIT_MAJOR = ScanConfig(split_major=True)
# Shared-page scans (a program scores a split's pages for up to 4 / 16 requests holding the same pages), timed on the
# same two page tables: on the case's own pages they only add the page-id comparisons
SHARED_PAGES = [ScanConfig(shared_pages=True), ScanConfig(shared_pages=True, shared_group=16)]
# The default scan with its merge fused, then with the merge as its own launch in fewer warps
MERGE_CONFIGS = [ScanConfig()] + [ScanConfig(fused_merge=False, merge_warps=warps) for warps in (1, 2, 4)]
ATTENTION_CONFIGS = [
    TritonDecodeConfig(),
    TritonDecodeConfig(pages_per_split=1),
    TritonDecodeConfig(pages_per_split=2),
    TritonDecodeConfig(pages_per_split=4),
    TritonDecodeConfig(pages_per_split=2, num_warps=8),
    TritonDecodeConfig(pages_per_split=4, num_stages=2),
    TritonDecodeConfig(fused_combine=False),
]
# What follows the scan, timed as whole layers (``measure_variants``): the default (the attention merges the lists
# from 2 requests up), without programmatic dependent launch, always the merge's own launch, always the attention.
VARIANTS = {
    "default": DecodeTuning(),
    "no_pdl": DecodeTuning(scan=ScanConfig(pdl=False), fp8_scan=ScanConfig(num_stages=2, pdl=False),
                           triton_attention=TritonDecodeConfig(pdl=False)),
    "merge_launch": DecodeTuning(select_in_attention_min_requests=None),
    "select": DecodeTuning(select_in_attention_min_requests=1),
}  # fmt: skip
PEER_COLUMNS = ["context", "batch", "default_us", "no_pdl_us", "merge_launch_us", "select_us", "peer_us", "dense_us",
                "best_variant", "best_vs_peer", "best_speedup", "default_fp8_us", "select_fp8_us", "best_fp8_us",
                "best_fp8_vs_peer", "best_speedup_fp8", "fp8_selection_overlap", "peer_heads_same_selection",
                "peer_max_abs_diff"]  # fmt: skip
COLUMNS = ["context", "batch", "index_us", "index_fused_us", "scan_us", "merge_us", "attn_us", "attn_fi_us",
           "total_us", "total_fi_us", "dense_us", "speedup", "index_scan_tbps", "index_fp8_us", "total_fp8_us",
           "speedup_fp8"]  # fmt: skip
SWEEP_COLUMNS = ["context", "batch", "part", "variant", "us", "tbps", "error"]
TUNED_COLUMNS = ["context", "batch", "scan_programs_per_sm", "scan", "attention", "fused_store", "total_us",
                 "dense_us", "speedup", "fp8_scan", "total_fp8_us", "speedup_fp8"]  # fmt: skip


@dataclass
class Timing:
    us: float  # per call, graph of many calls
    single_replay_us: float  # per call, one graph of one pass per replay (earlier runs' method)
    method: str


def _capture(calls: Callable[[], Any]) -> torch.cuda.CUDAGraph | None:
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            calls()
    except Exception as exc:  # a path that cannot be captured is still timed, eagerly
        logger.warning("graph capture failed (%s); timing eagerly", exc)
        torch.cuda.synchronize()
        return None
    return graph


def _median_us(run: Callable[[], None], replays: int) -> float:
    run()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def time_layers(call: Callable[[int], Any], layers: int, replays: int = 10) -> Timing:
    """Microseconds per ``call(layer)``: see the module docstring."""

    def one_pass() -> None:
        for layer in range(layers):
            call(layer)

    one_pass()  # compile, plan caches, allocator warm-up
    torch.cuda.synchronize()
    graph = _capture(one_pass)
    if graph is None:
        us = _median_us(one_pass, replays) / layers
        return Timing(us, us, "eager")
    single = _median_us(graph.replay, 5) / layers
    repeats = max(1, min(MAX_REPEATS, math.ceil(TARGET_REPLAY_US / (single * layers))))
    if repeats > 1:
        del graph
        graph = _capture(lambda: [one_pass() for _ in range(repeats)])
        if graph is None:
            return Timing(single, single, "cuda_graph_single")
    return Timing(_median_us(graph.replay, replays) / (layers * repeats), single, "cuda_graph")


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
    fp8_caches: list[LayerKVCache] | None = None

    @property
    def layers(self) -> int:
        return len(self.caches)

    @property
    def index_bytes(self) -> int:
        return self.batch * self.context * M3.index_head_dim * 2

    @property
    def layer_args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_new, self.k_new, self.index_q, self.index_k_new

    def fp8(self) -> list[LayerKVCache]:
        """The same caches with the engine's fp8 k-index (``--index-dtype fp8_e4m3``: e4m3 keys with a float32 scale
        per token, in raw pages holding both), made once."""
        if self.fp8_caches is None:
            self.fp8_caches = [LayerKVCache(c.key, c.value, *fp8_index_from(c.index_key)) for c in self.caches]
        return self.fp8_caches


def case_layers(context: int, batch: int, free_bytes: int) -> tuple[int, int]:
    """(layers, pages per layer) that rotate >= ROTATION_BYTES of k-index and fit in ``free_bytes``
    (with room for an fp8 copy of the k-index)."""
    pages = batch * math.ceil(context / M3.block_size) + 1  # page 0 stays unused
    index_page = M3.block_size * M3.index_head_dim * 2
    page_bytes = 2 * M3.num_kv_heads * M3.block_size * M3.head_dim * 2 + index_page * 3 // 2
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


def backend_for(caches: list[LayerKVCache], tuning: DecodeTuning, use_flashinfer: bool) -> GpuAttentionBackend:
    return GpuAttentionBackend(caches, topk_blocks=M3.topk, local_blocks=M3.local_blocks, num_q_heads=M3.num_q_heads,
                               use_flashinfer=use_flashinfer, decode_tuning=tuning)  # fmt: skip


def time_layer(case: Case, tuning: DecodeTuning, use_flashinfer: bool, fp8: bool = False) -> Timing:
    """The whole MSA layer as the model calls it, ``GpuAttentionBackend.sparse``."""
    backend = backend_for(case.fp8() if fp8 else case.caches, tuning, use_flashinfer)
    backend.begin_step(case.metadata)
    return time_layers(lambda layer: backend.sparse(layer, *case.layer_args), case.layers)


def time_dense(case: Case, use_flashinfer: bool) -> Timing:
    """The dense peer over the same K/V tensors, as dense layers (no index keys)."""
    backend = backend_for([LayerKVCache(c.key, c.value, None) for c in case.caches], DecodeTuning(), use_flashinfer)
    backend.begin_step(case.metadata)
    return time_layers(lambda layer: backend.dense(layer, *case.layer_args[:3]), case.layers)


def time_index(case: Case, plan: SparseDecodePlan, config: ScanConfig, fp8: bool = False,
               metadata: AttentionMetadata | None = None) -> float:  # fmt: skip
    caches = case.fp8() if fp8 else case.caches
    metadata = metadata or case.metadata
    return time_layers(lambda layer: decode_index_topk(case.index_q, caches[layer].index_key, metadata, plan, config,
                                                       index_key_scale=caches[layer].index_key_scale),
                       case.layers).us  # fmt: skip


def shared_prefix_metadata(case: Case) -> AttentionMetadata:
    """The case's step with every request reading the first request's pages, but for its own last block."""
    page_table = case.metadata.page_table.clone()
    page_table[1:, :-1] = page_table[0, :-1]
    return dataclasses.replace(case.metadata, page_table=page_table)


def time_attention(case: Case, plan: SparseDecodePlan, config: TritonDecodeConfig | None,
                   flashinfer: FlashInferSparseDecode | None) -> float:  # fmt: skip
    """Sparse attention over the pages ``plan`` holds (filled by an index call before)."""
    scale = M3.head_dim**-0.5
    metadata = case.metadata

    def call(layer: int) -> torch.Tensor:
        cache = case.caches[layer]
        return sparse_decode_attention(case.q, cache.key, cache.value, plan, metadata.positions, metadata.page_table,
                                       scale, flashinfer, triton_config=config)  # fmt: skip

    return time_layers(call, case.layers).us


def planned_flashinfer(plan: SparseDecodePlan, device: torch.device) -> FlashInferSparseDecode:
    flashinfer = FlashInferSparseDecode(device)
    flashinfer.plan(plan, torch.bfloat16, M3.head_dim**-0.5)
    return flashinfer


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


def measure(case: Case, use_flashinfer: bool, peer: msa_peer.Peer | None = None) -> dict[str, Any]:
    """The default layer, its parts, the FlashInfer variant, fp8 and the dense peer (the ``rows``)."""
    device = case.q.device
    metadata, last = case.metadata, case.layers - 1
    row: dict[str, Any] = {"context": case.context, "batch": case.batch, "layers": case.layers}
    plan = plan_sparse_decode(metadata, M3, device)
    row["scan_splits"] = plan.scan_splits
    default_scan = DecodeTuning().scan_for(case.batch, fp8_index=False)
    row["index_us"] = time_index(case, plan, default_scan)
    row["index_scan_tbps"] = case.index_bytes / (row["index_us"] * 1e-6) / 1e12
    row["index_fused_us"] = time_index(case, plan, ScanConfig())
    separate = dataclasses.replace(default_scan, fused_merge=False)
    keys = [c.index_key for c in case.caches]
    row["scan_us"] = time_layers(
        lambda layer: scan_index_pages(case.index_q, keys[layer], metadata, plan, separate), case.layers
    ).us
    scan = scan_index_pages(case.index_q, keys[last], metadata, plan, separate)
    row["merge_us"] = time_layers(lambda _layer: merge_selection(scan, metadata, plan), case.layers).us
    # Both merges must agree (page ids of the last layer), and leave the scan's counters at zero.
    separate_pages = plan.page_ids.clone()
    selected = decode_index_topk(case.index_q, keys[last], metadata, plan)
    row["merges_agree"] = bool(torch.equal(separate_pages, plan.page_ids)) and not bool(plan.scan_counters.any())
    row["attn_us"] = time_attention(case, plan, None, None)
    out = sparse_decode_attention(case.q, case.caches[last].key, case.caches[last].value, plan, metadata.positions,
                                  metadata.page_table, M3.head_dim**-0.5)  # fmt: skip
    if use_flashinfer:
        flashinfer = planned_flashinfer(plan, device)
        row["attn_fi_us"] = time_attention(case, plan, None, flashinfer)
        cache = case.caches[last]
        out_fi = sparse_decode_attention(case.q, cache.key, cache.value, plan, metadata.positions,
                                         metadata.page_table, M3.head_dim**-0.5, flashinfer)  # fmt: skip
        row["attn_paths_max_diff"] = float((out.float() - out_fi.float()).abs().max())
    total = time_layer(case, DecodeTuning(), use_flashinfer)
    row["total_us"], row["total_1replay_us"] = total.us, total.single_replay_us
    if use_flashinfer:
        fi = DecodeTuning(attention="flashinfer", fused_store=False)
        row["total_fi_us"] = time_layer(case, fi, use_flashinfer).us
    dense = time_dense(case, use_flashinfer)
    row["dense_us"], row["dense_1replay_us"] = dense.us, dense.single_replay_us
    row["speedup"] = row["dense_us"] / row["total_us"]
    row["index_fp8_us"] = time_index(case, plan, DecodeTuning().scan_for(case.batch, fp8_index=True), fp8=True)
    row["index_fp8_tbps"] = case.index_bytes / 2 / (row["index_fp8_us"] * 1e-6) / 1e12
    row["total_fp8_us"] = time_layer(case, DecodeTuning(), use_flashinfer, fp8=True).us
    row["speedup_fp8"] = row["dense_us"] / row["total_fp8_us"]
    if total.method != "cuda_graph" or dense.method != "cuda_graph":
        row["timing"] = f"total {total.method}, dense {dense.method}"
    if case.context <= 131072:
        row.update(check_request0(case, selected, out))
    measure_variants(case, row, use_flashinfer)
    if peer is not None:
        measure_peer(case, peer, row, selected, out)
    return row


def measure_variants(case: Case, row: dict[str, Any], use_flashinfer: bool) -> None:
    """The layer with each way of running what follows the scan, bf16 and fp8 k-index (``VARIANTS``), and the
    fastest of them (``best_us``, ``best_fp8_us``, ``best_variant``)."""
    best: dict[bool, tuple[float, str]] = {}
    for name, tuning in VARIANTS.items():
        for fp8 in (False, True):
            key = f"{name}_fp8_us" if fp8 else f"{name}_us"
            try:
                row[key] = time_layer(case, tuning, use_flashinfer, fp8=fp8).us
            except Exception as exc:
                logger.exception("variant %s failed", key)
                row.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            if row[key] < best.get(fp8, (math.inf, ""))[0]:
                best[fp8] = (row[key], name)
    for fp8, suffix in ((False, ""), (True, "_fp8")):
        if fp8 in best:
            row[f"best{suffix}_us"], row[f"best{suffix}_variant"] = best[fp8]
            row[f"best_speedup{suffix}"] = row["dense_us"] / best[fp8][0]
    guarded(row, "fp8_selection", lambda: fp8_selection_overlap(case, row))
    if case.context <= 131072:
        guarded(row, "select_check", lambda: check_select_in_attention(case, row))


def guarded(row: dict[str, Any], name: str, check: Callable[[], None]) -> None:
    """Run a row's extra check; a failure is logged into the row, never loses the row's timings."""
    try:
        check()
    except Exception as exc:
        logger.exception("%s failed", name)
        row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]


def fp8_selection_overlap(case: Case, row: dict[str, Any]) -> None:
    """The fp8 k-index's selections against the bf16 one's over the same keys (every request and head)."""
    last, fp8_last = case.caches[-1], case.fp8()[-1]
    plan = plan_sparse_decode(case.metadata, M3, case.q.device)
    bf16_selected = decode_index_topk(case.index_q, last.index_key, case.metadata, plan).clone()
    fp8_selected = decode_index_topk(case.index_q, fp8_last.index_key, case.metadata, plan,
                                     index_key_scale=fp8_last.index_key_scale)  # fmt: skip
    shared, held = reference.selection_overlap(bf16_selected, fp8_selected)
    row["fp8_selection_overlap"] = shared / max(held, 1)


def check_select_in_attention(case: Case, row: dict[str, Any]) -> None:
    """The attention merging the lists, called directly on the last layer: its answer for request 0 against the fp32
    reference, as the default's (PDL's ordering is covered there and by tests/gpu)."""
    last, metadata = case.caches[-1], case.metadata
    plan = plan_sparse_decode(metadata, M3, case.q.device)
    scan = scan_index_pages(case.index_q, last.index_key, metadata, plan, ScanConfig(fused_merge=False))
    out = select_and_attend(case.q, last.key, last.value, scan, metadata, plan, M3.head_dim**-0.5)
    row.update({f"select_{k}": v for k, v in check_request0(case, scan.selected, out).items()})


def measure_peer(case: Case, peer: msa_peer.Peer, row: dict[str, Any], selected: torch.Tensor,
                 out: torch.Tensor) -> None:  # fmt: skip
    """The peer's decode layer (index + attention, without the new keys' store, which vLLM runs as its own op)
    over the same index keys, K/V contents, queries and page table, timed as ours; ours / peer per row."""
    metadata = case.metadata
    dims = msa_peer.PeerDims(num_kv_heads=M3.num_kv_heads, topk=M3.topk, local_blocks=M3.local_blocks,
                             scale=M3.head_dim**-0.5)  # fmt: skip
    peer_kv = [msa_peer.interleaved_kv(c.key, c.value) for c in case.caches]
    buffer = msa_peer.topk_buffer(case.batch, M3.num_kv_heads, M3.topk, case.q.device)
    peer_out = torch.empty_like(case.q)
    msa_peer.reset_autotune(peer)

    def call(layer: int, caches: list[LayerKVCache]) -> None:
        msa_peer.decode_layer(peer, dims, case.index_q, caches[layer].index_key, case.q, peer_kv[layer],
                              metadata.page_table, metadata.seq_lens, case.context, buffer, peer_out)  # fmt: skip

    try:
        row["peer_us"] = time_layers(lambda layer: call(layer, case.caches), case.layers).us
        row["peer_fp8_us"] = row["peer_us"]  # the peer's index cache is bf16 only
        for ours in ("total", "default", "best"):
            if row.get(f"{ours}_us"):
                row[f"{ours}_vs_peer"] = row["peer_us"] / row[f"{ours}_us"]
            if row.get(f"{ours}_fp8_us"):
                row[f"{ours}_fp8_vs_peer"] = row["peer_us"] / row[f"{ours}_fp8_us"]
        if case.context <= 131072:
            call(case.layers - 1, case.caches)
            peer_sel = buffer[: case.batch].transpose(0, 1)[:, :1]
            same = [set(a.tolist()) - {-1} == set(b.tolist()) - {-1}
                    for a, b in zip(peer_sel[:, 0], selected[:, 0], strict=True)]  # fmt: skip
            row["peer_heads_same_selection"] = sum(same)
            row["peer_max_abs_diff"] = float((peer_out[:1].float() - out[:1].float()).abs().max())
    except Exception as exc:
        logger.exception("peer decode failed")
        row.setdefault("errors", {})["peer"] = f"{type(exc).__name__}: {exc}"[:300]


def sweep(case: Case, use_flashinfer: bool, deadline: float) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Each decode-layer choice varied alone around the defaults; then the layer with the fastest index
    and attention choices (``tuned``)."""
    device, metadata = case.q.device, case.metadata
    results: list[dict[str, Any]] = []
    base = {"context": case.context, "batch": case.batch}

    def record(part: str, variant: str, measure_us: Callable[[], float], index_bytes: int = 0) -> None:
        entry: dict[str, Any] = {**base, "part": part, "variant": variant}
        if time.monotonic() > deadline:
            entry["error"] = "skipped: time budget"
        else:
            try:
                entry["us"] = measure_us()
                if index_bytes:
                    entry["tbps"] = index_bytes / (entry["us"] * 1e-6) / 1e12
            except Exception as exc:
                logger.exception("sweep %s %s failed", part, variant)
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        results.append(entry)
        logger.info("sweep %s", entry)

    plans = {n: plan_sparse_decode(metadata, M3, device, scan_programs_per_sm=n) for n in SCAN_PROGRAMS_PER_SM}
    for n, plan in plans.items():
        record("index", f"programs_per_sm={n} splits={plan.scan_splits}",
               lambda p=plan: time_index(case, p, ScanConfig()), case.index_bytes)  # fmt: skip
    default_plan = plan_sparse_decode(metadata, M3, device)
    for config in SCAN_CONFIGS[1:]:
        record("index", scan_name(config), lambda c=config: time_index(case, default_plan, c), case.index_bytes)
    for config in SCAN_CONFIGS[:2] + SCAN_CONFIGS[4:5]:
        record("index_fp8", scan_name(config), lambda c=config: time_index(case, default_plan, c, fp8=True),
               case.index_bytes // 2)  # fmt: skip
    # Half the shared memory per stage lets an fp8 scan run 4 programs per SM in one wave (bf16 fits 3), and
    # a shallower bf16 pipeline may too: both only at that occupancy (not the tuned layer's choices).
    crowded = plans[4]
    for config in (ScanConfig(num_stages=2), ScanConfig(), ScanConfig(num_stages=4)):
        record("index_fp8", f"programs_per_sm=4 splits={crowded.scan_splits} {scan_name(config)}",
               lambda c=config: time_index(case, crowded, c, fp8=True), case.index_bytes // 2)  # fmt: skip
    record("index_occupancy", f"programs_per_sm=4 splits={crowded.scan_splits} {scan_name(SCAN_CONFIGS[1])}",
           lambda: time_index(case, crowded, SCAN_CONFIGS[1]), case.index_bytes)  # fmt: skip
    # Page ids one iteration ahead: the key tiles are then really multi-buffered (bench.sm90_compile: 100 KiB of
    # shared memory at 3 stages, 2 programs per SM; 68 KiB, i.e. one tile ahead whatever the stages, without).
    for fp8, configs in ((False, AHEAD_CONFIGS), (True, FP8_AHEAD_CONFIGS)):
        for config, programs in configs:
            record("index_fp8_ahead" if fp8 else "index_ahead",
                   f"programs_per_sm={programs} splits={plans[programs].scan_splits} {scan_name(config)}",
                   lambda c=config, n=programs, f=fp8: time_index(case, plans[n], c, fp8=f),
                   case.index_bytes // (2 if fp8 else 1))  # fmt: skip
    # Each config with the plan the engine would make for it (a shared-page scan's plan has finer splits).
    config_plans = {config: plan_sparse_decode(metadata, M3, device,
                                               scan_programs_per_sm=DecodeTuning(scan=config).planned_programs_per_sm)
                    for config in (ScanConfig(), SPLIT_MAJOR, *SHARED_PAGES)}  # fmt: skip
    for config in (SPLIT_MAJOR, *SHARED_PAGES):
        record("index", scan_name(config), lambda c=config: time_index(case, config_plans[c], c), case.index_bytes)
    if case.batch > 1:
        shared = shared_prefix_metadata(case)
        for config in config_plans:
            record("index_shared_prefix", scan_name(config),
                   lambda c=config: time_index(case, config_plans[c], c, metadata=shared),
                   case.index_bytes)  # fmt: skip
    # The merge's serial tail (~10 us at any context, 2026-12-01) fused, or as its own launch in fewer warps.
    for config in MERGE_CONFIGS:
        record("index_merge", scan_name(config), lambda c=config: time_index(case, default_plan, c),
               case.index_bytes)  # fmt: skip
    decode_index_topk(case.index_q, case.caches[-1].index_key, metadata, default_plan)
    for config in ATTENTION_CONFIGS[1:]:
        record("attention", attention_name(config), lambda c=config: time_attention(case, default_plan, c, None))
    if use_flashinfer:
        flashinfer = planned_flashinfer(default_plan, device)
        record("attention", "flashinfer", lambda: time_attention(case, default_plan, None, flashinfer))
    record("layer", "separate store", lambda: time_layer(case, DecodeTuning(fused_store=False), use_flashinfer).us)
    if use_flashinfer:
        fi_fused = DecodeTuning(attention="flashinfer")
        record("layer", "flashinfer attention, fused store", lambda: time_layer(case, fi_fused, use_flashinfer).us)
    tuned = tuned_layer(case, results, use_flashinfer, deadline)
    return results, tuned


def scan_name(config: ScanConfig) -> str:
    name = f"pages={config.pages_per_iteration} warps={config.num_warps} stages={config.num_stages}"
    name += "" if config.fused_merge else f" separate merge warps={config.merge_warps}"
    name += (" page ids ahead" if config.page_ids_ahead else "") + (" split-major" if config.split_major else "")
    return name + (f" shared pages group={config.shared_group}" if config.shared_pages else "")


def attention_name(config: TritonDecodeConfig) -> str:
    return (f"triton pages_per_split={config.pages_per_split} warps={config.num_warps} stages={config.num_stages}"
            + ("" if config.fused_combine else " separate combine"))  # fmt: skip


BF16_SCAN_PARTS = ("index", "index_ahead")
FP8_SCAN_PARTS = ("index_fp8", "index_fp8_ahead")


def fastest_scan(results: list[dict[str, Any]], defaults: DecodeTuning,
                 parts: tuple[str, ...] = BF16_SCAN_PARTS) -> tuple[int, ScanConfig]:  # fmt: skip
    """Programs per SM and scan config of the fastest index variant among ``parts``, then with the merge's own
    launch if one of those beat the fused merge (``index_merge``: both at the default scan)."""
    timed = [r for r in results if r["part"] in parts and "us" in r]
    if not timed:
        return defaults.scan_programs_per_sm, defaults.scan
    variant = min(timed, key=lambda r: r["us"])["variant"]
    known = SCAN_CONFIGS + [config for config, _ in AHEAD_CONFIGS + FP8_AHEAD_CONFIGS] + [SPLIT_MAJOR, *SHARED_PAGES]
    if not variant.startswith("programs_per_sm="):  # a scan config at the default programs per SM
        programs, config_name = defaults.scan_programs_per_sm, variant
    else:
        count, _, rest = variant.removeprefix("programs_per_sm=").partition(" splits=")
        programs, config_name = int(count), rest.partition(" ")[2]  # empty after the split count: the default
    # A variant without a config name ran the scan's default launch (the merge fused, as every scan variant).
    scan = next((c for c in known if scan_name(c) == config_name), ScanConfig())
    merges = [r for r in results if r["part"] == "index_merge" and "us" in r]
    if merges:
        best = min(merges, key=lambda r: r["us"])["variant"]
        merge = next(c for c in MERGE_CONFIGS if scan_name(c) == best)
        scan = dataclasses.replace(scan, fused_merge=merge.fused_merge, merge_warps=merge.merge_warps)
    return programs, scan


def tuned_layer(case: Case, results: list[dict[str, Any]], use_flashinfer: bool,
                deadline: float) -> dict[str, Any] | None:  # fmt: skip
    """The layer with each sweep's fastest choice, timed against the dense peer again."""
    if time.monotonic() > deadline + 20:
        return None

    def fastest(part: str, default: str) -> str:
        timed = [r for r in results if r["part"] == part and "us" in r]
        return min(timed, key=lambda r: r["us"])["variant"] if timed else default

    defaults = DecodeTuning()
    programs, scan = fastest_scan(results, defaults)
    fp8_programs, fp8_scan = fastest_scan(results, defaults, FP8_SCAN_PARTS)
    attention = fastest("attention", attention_name(defaults.triton_attention))
    triton_config = next((c for c in ATTENTION_CONFIGS if attention_name(c) == attention), defaults.triton_attention)
    layer_times = {r["variant"]: r["us"] for r in results if r["part"] == "layer" and "us" in r}
    fused_store = layer_times.get("separate store", math.inf) >= min(layer_times.values(), default=math.inf)
    tuning = DecodeTuning(scan=scan, scan_programs_per_sm=programs,
                          attention="flashinfer" if attention == "flashinfer" else "triton",
                          triton_attention=triton_config, fused_store=fused_store,
                          single_request_merge_warps=None)  # the sweep's merge choice is in ``scan``  # fmt: skip
    fp8_tuning = dataclasses.replace(tuning, fp8_scan=fp8_scan, scan_programs_per_sm=fp8_programs)
    entry: dict[str, Any] = {"context": case.context, "batch": case.batch, "scan_programs_per_sm": programs,
                             "scan": scan_name(scan), "attention": attention, "fused_store": fused_store,
                             "fp8_scan": f"programs_per_sm={fp8_programs} {scan_name(fp8_scan)}"}  # fmt: skip
    try:
        entry["total_us"] = time_layer(case, tuning, use_flashinfer).us
        entry["dense_us"] = time_dense(case, use_flashinfer).us
        entry["speedup"] = entry["dense_us"] / entry["total_us"]
        entry["total_fp8_us"] = time_layer(case, fp8_tuning, use_flashinfer, fp8=True).us
        entry["speedup_fp8"] = entry["dense_us"] / entry["total_fp8_us"]
    except Exception as exc:
        logger.exception("tuned layer failed")
        entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
    logger.info("tuned %s", entry)
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    parser.add_argument("--contexts", type=int_list, default=CONTEXTS)
    parser.add_argument("--batches", type=int_list, default=BATCHES)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-peer", action="store_true", help="skip the reference stack's kernels (bench.msa_peer)")
    parser.add_argument("--sweep-cases", default=",".join(f"{c}x{b}" for c, b in SWEEP_CASES),
                        help="CONTEXTxBATCH cases to sweep (those among the timed ones)")  # fmt: skip
    parser.add_argument("--table", type=Path, default=None, help="print the tables of a results file and exit")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.table is not None:
        payload = json.loads(args.table.read_text())
        print_tables(payload["rows"], payload.get("decode_sweep", []), payload.get("tuned", []))
        return 0
    rows: list[dict[str, Any]] = []
    sweeps: list[dict[str, Any]] = []
    tuned: list[dict[str, Any]] = []
    defaults = DecodeTuning()
    extra: dict[str, Any] = {"shape": M3.__dict__, "decode_tuning": dataclasses.asdict(defaults),
                             "decode_sweep": sweeps, "tuned": tuned}  # fmt: skip

    def save() -> None:
        write_results("msa_decode", sorted(rows, key=lambda r: (r["context"], r["batch"])), extra, args.out)

    if not torch.cuda.is_available():
        rows.append({"context": 0, "batch": 0, "error": "no CUDA device"})
        save()
        return 1
    device = torch.device("cuda")
    use_flashinfer = flashinfer_available(device)
    extra["flashinfer"] = use_flashinfer
    peer = None if args.no_peer else msa_peer.load_peer()
    extra["peer"] = peer.describe() if peer is not None else None
    wanted = [(c, b) for c in args.contexts for b in args.batches]
    sweep_cases = [tuple(int(n) for n in case.split("x")) for case in args.sweep_cases.split(",") if case]
    swept = [] if args.no_sweep else [cb for cb in sweep_cases if cb in wanted]
    # The swept cases first (row, sweep, tuned row while their caches exist), then the other rows.
    order = [cb for cb in SWEEP_CASES if cb in wanted] + sorted(
        (cb for cb in wanted if cb not in SWEEP_CASES), key=lambda cb: (cb[1] > 8, -cb[0], cb[1])
    )
    started = time.monotonic()
    generator = torch.Generator(device=device).manual_seed(0)
    for context, batch in order:
        row: dict[str, Any] = {"context": context, "batch": batch}
        if time.monotonic() - started > TIME_BUDGET_S:
            rows.append({**row, "skipped": "time budget"})
            continue
        case: Case | str | None = None
        try:
            case = build_case(context, batch, device, generator)
            row = {**row, "skipped": case} if isinstance(case, str) else measure(case, use_flashinfer, peer)
        except Exception as exc:
            logger.exception("case context=%d batch=%d failed", context, batch)
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)
        logger.info("%s", row)
        save()
        if (context, batch) in swept and isinstance(case, Case):
            deadline = min(time.monotonic() + SWEEP_BUDGET_S, started + TIME_BUDGET_S)
            try:
                results, best = sweep(case, use_flashinfer, deadline)
                sweeps.extend(results)
                tuned.extend([best] if best is not None else [])
            except Exception as exc:
                logger.exception("sweep context=%d batch=%d failed", context, batch)
                sweeps.append({"context": context, "batch": batch, "error": f"{type(exc).__name__}: {exc}"[:500]})
            save()
        case = None
        torch.cuda.empty_cache()
    save()
    print_tables(rows, sweeps, tuned)
    return 0


def print_tables(rows: list[dict[str, Any]], sweeps: list[dict[str, Any]], tuned: list[dict[str, Any]]) -> None:
    """The sweep (fastest first per case and part), the tuned rows, then the results table, last: the GPU
    run's reply shows the tail."""
    tables = []
    timed = sorted((s for s in sweeps if "us" in s), key=lambda s: (s["context"], s["batch"], s["part"], s["us"]))
    failed = [s for s in sweeps if "us" not in s]
    if timed or failed:
        tables.append(markdown_table(timed + failed, SWEEP_COLUMNS))
    if tuned:
        tables.append(markdown_table(sorted(tuned, key=lambda r: (r["context"], r["batch"])), TUNED_COLUMNS))
    tables.append(markdown_table(sorted(rows, key=lambda r: (r["context"], r["batch"])), COLUMNS))
    tables.append(markdown_table(sorted(rows, key=lambda r: (r["context"], r["batch"])), PEER_COLUMNS))
    sys.stdout.write("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
