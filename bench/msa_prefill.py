"""MSA prefill, one layer at M3 attention dims, on the GPU: the Triton indexer (block scores + top-K),
KV-block-major and query-major sparse attention on the same selections, against dense causal flash
attention (FlashInfer prefill and torch SDPA's flash backend; the faster is the peer) in the same run.

One request prefills ``context`` tokens from scratch (T = context), pages shuffled over the pool,
fresh random bf16 inputs.  Run (GPU machine, from the repository root; ~5 minutes):

    python -m bench.msa_prefill [--out DIR] [--contexts 8192,32768,131072,262144,1048576]
    python -m bench.msa_prefill --table bench/results/msa_prefill.json   # the tables again, no GPU needed

Writes ``<out or bench/results>/msa_prefill.json`` after every context (rows: ``context``,
``indexer_ms``, ``block_major_ms`` and its phases ``csr_ms`` / ``attend_ms`` / ``merge_ms``,
``query_major_ms``, ``msa_total_ms``, ``dense_ms`` and the details: FlashInfer and SDPA times,
achieved TFLOP/s and TB/s, work items, peak extra memory), the sweep, the launch configs it picked
and the registers / spills / shared memory of every kernel variant compiled, and prints markdown
tables last.  Targets (docs/msa.md#performance-targets): MSA layer >= 8x faster than dense at 128K and growing with
context; block-major >= 1.5x query-major at 128K.  Dense runs up to 256K; beyond,
``dense_ms_extrapolated`` scales the 256K time by the causal (context^2) FLOPs.
"""

import argparse
import dataclasses
import json
import logging
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import triton

from bench import msa_peer
from bench.common import cuda_time_us, int_list, markdown_table, write_results
from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import fp8_index_from
from m3stack.engine.msa import prefill_block_major, prefill_csr, prefill_index, prefill_query_major, reference
from m3stack.engine.msa.prefill_attention import DEFAULT_WORKSPACE_BYTES, sparse_prefill
from m3stack.engine.msa.prefill_block_major import BlockMajorPlan, attend_chunk, merge_chunk, plan_block_major
from m3stack.engine.msa.prefill_common import PrefillTuning
from m3stack.engine.msa.prefill_csr import ITEM_END, ITEM_FIRST, ITEM_HEAD
from m3stack.engine.msa.prefill_index import IndexTuning, prefill_index_topk

logger = logging.getLogger("bench.msa_prefill")

# M3 attention dims (docs/msa.md#semantics).
Q_HEADS, KV_HEADS, HEAD_DIM, INDEX_DIM, BLOCK, TOPK, LOCAL = 64, 4, 128, 128, 128, 16, 1
GROUP = Q_HEADS // KV_HEADS
SCALE = HEAD_DIM**-0.5
DENSE_MAX_CONTEXT = 262144
SWEEP_CONTEXT = 131072
# Candidate launch configs, swept once at SWEEP_CONTEXT (the first of each list is the kernel's
# default); the fastest is used for every context.  `python -m bench.sm90_compile` compiles them
# all for sm_90 without a GPU (registers, shared memory, CTAs per SM in the comments: Triton 3.6).
INDEX_CONFIGS = [
    IndexTuning(tile_tokens=32, num_warps=8, num_stages=2),  # 128 rows, 2 CTAs/SM, next key block in flight
    IndexTuning(tile_tokens=32, num_warps=8, num_stages=3),  # 1 CTA/SM, two key blocks in flight
    IndexTuning(tile_tokens=64, num_warps=16, num_stages=2),  # 256 rows: half the key traffic from L2
    IndexTuning(tile_tokens=64, num_warps=16, num_stages=3),
    IndexTuning(tile_tokens=16, num_warps=4, num_stages=3),  # 64 rows, 2 CTAs/SM, two blocks in flight
]
BLOCK_MAJOR_CONFIGS = [
    PrefillTuning(tile_tokens=4, num_warps=4, prefetch=True),  # 64 rows, 2 CTAs/SM, next q tile in registers
    PrefillTuning(tile_tokens=4, num_warps=4, prefetch=False, num_stages=2),  # 2 CTAs/SM, q staged just in time
    PrefillTuning(tile_tokens=4, num_warps=4, prefetch=False, num_stages=3),  # 1 CTA/SM, q one tile ahead
    PrefillTuning(tile_tokens=8, num_warps=8, prefetch=True),  # 128 rows, 1 CTA/SM
    PrefillTuning(tile_tokens=8, num_warps=8, prefetch=False, num_stages=3),  # 128 rows, 1 CTA/SM
]
# Then, with the fastest of those (runtime arguments, no recompiles): work-item size and workspace;
# last the merge kernel's launch.
TILES_PER_ITEM = [32, 16, 64]
WORKSPACES = [DEFAULT_WORKSPACE_BYTES, 512 << 20, 1 << 30, 8 << 30]
# (merge_num_warps, merge_num_stages, merge_tokens)
MERGE_CONFIGS = [(4, 3, 2), (4, 3, 1), (4, 4, 2), (4, 3, 4), (2, 4, 2), (8, 3, 2), (4, 5, 4)]


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    tuning: PrefillTuning = dataclasses.field(default_factory=PrefillTuning)
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES


def time_ms(fn: Callable[[], Any], max_seconds: float = 1.5) -> float:
    """Median GPU time of ``fn``; long calls (> 50 ms) get 3 timed runs after one warm-up."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - start
    if once < 0.05:
        return cuda_time_us(fn) / 1e3
    runs = max(1, min(3, int(max_seconds / once)))
    times = []
    for _ in range(runs):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def peak_extra_mib(fn: Callable[[], Any]) -> float:
    """Memory ``fn`` allocates above what was live before it (its output included), in MiB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


class Layer:
    """One MSA layer's inputs for a single request prefilling ``context`` tokens."""

    def __init__(self, context: int, seed: int, device: torch.device) -> None:
        generator = torch.Generator(device=device).manual_seed(seed)
        pages = math.ceil(context / BLOCK)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)

        self.q = randn(context, Q_HEADS, HEAD_DIM)
        self.index_q = randn(context, KV_HEADS, INDEX_DIM)
        self.key = randn(context, KV_HEADS, HEAD_DIM)
        self.value = randn(context, KV_HEADS, HEAD_DIM)
        index_key = randn(context, INDEX_DIM)
        page_table = torch.randperm(pages, generator=generator, device=device).to(torch.int32)
        positions = torch.arange(context, device=device)
        page, offset = page_table[positions // BLOCK].long(), positions % BLOCK
        self.key_cache = torch.zeros((pages, KV_HEADS, BLOCK, HEAD_DIM), dtype=torch.bfloat16, device=device)
        self.value_cache = torch.zeros_like(self.key_cache)
        self.index_key_cache = torch.zeros((pages, BLOCK, INDEX_DIM), dtype=torch.bfloat16, device=device)
        self.key_cache[page, :, offset] = self.key
        self.value_cache[page, :, offset] = self.value
        self.index_key_cache[page, offset] = index_key
        del index_key
        self.metadata = AttentionMetadata(
            block_size=BLOCK,
            query_start_loc=torch.tensor([0, context], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([context], dtype=torch.int32, device=device),
            positions=positions,
            slot_mapping=page * BLOCK + offset,
            page_table=page_table[None],
            query_start_loc_cpu=torch.tensor([0, context], dtype=torch.int32),
            seq_lens_cpu=torch.tensor([context], dtype=torch.int32),
        )

    def index(self, tuning: IndexTuning | None) -> torch.Tensor:
        return prefill_index_topk(self.index_q, self.index_key_cache, self.metadata, TOPK, LOCAL, tuning)

    def attend(self, selection: torch.Tensor, method: str, config: AttentionConfig) -> torch.Tensor:
        return sparse_prefill(
            self.q, self.key_cache, self.value_cache, selection, self.metadata, SCALE, method,
            workspace_bytes=config.workspace_bytes, tuning=config.tuning,
        )  # fmt: skip

    # Block-major's phases, timed apart: the inversion (+ workspace), every chunk's attention, every merge.
    def plan(self, selection: torch.Tensor, config: AttentionConfig) -> BlockMajorPlan:
        return plan_block_major(self.q, selection, self.metadata, config.workspace_bytes, config.tuning)

    def attend_chunks(self, plan: BlockMajorPlan) -> None:
        for chunk in range(plan.num_chunks):
            attend_chunk(plan, chunk, self.q, self.key_cache, self.value_cache, self.metadata, SCALE)

    def merge_chunks(self, plan: BlockMajorPlan, selection: torch.Tensor, out: torch.Tensor) -> None:
        """Every chunk's merge (the workspace holds the last chunk's partials: same work, same time)."""
        for chunk in range(plan.num_chunks):
            merge_chunk(plan, chunk, selection, self.metadata, out)

    def selected_pairs(self, selection: torch.Tensor) -> tuple[int, int]:
        """(valid (token, KV head, block) selections, visible keys summed over them)."""
        positions = self.metadata.positions[None, :, None]
        valid = (selection >= 0) & (selection <= positions // BLOCK)
        visible = torch.clamp(positions - selection.long() * BLOCK + 1, 0, BLOCK)
        return int(valid.sum()), int(torch.where(valid, visible, 0).sum())

    def index_flops(self) -> float:
        """2 * d FLOPs per (index head, key of each ranked candidate block): the causal block triangle."""
        first_local = torch.clamp(self.metadata.positions // BLOCK - LOCAL + 1, min=0)
        return 2.0 * INDEX_DIM * KV_HEADS * BLOCK * float(first_local.sum())


def dense_flashinfer(layer: Layer) -> Callable[[], Any]:
    import flashinfer

    return lambda: flashinfer.single_prefill_with_kv_cache(layer.q, layer.key, layer.value, causal=True)


def dense_sdpa(layer: Layer) -> Callable[[], Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = layer.q.transpose(0, 1)[None]
    k = layer.key.repeat_interleave(GROUP, dim=1).transpose(0, 1)[None]
    v = layer.value.repeat_interleave(GROUP, dim=1).transpose(0, 1)[None]

    def run() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def describe(config: Any) -> str:
    """A launch config in a few words: its fields that are set (nested configs flattened)."""
    parts = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            parts.append(describe(value))
        elif value is not None:
            parts.append(f"{field.name}={value >> 20}MiB" if field.name.endswith("bytes") else f"{field.name}={value}")
    return " ".join(parts)


def attempt(row: dict[str, Any], key: str, fn: Callable[[], float]) -> float | None:
    try:
        value = fn()
    except Exception as error:  # a failing case must not lose the others
        logger.error("%s at context %s failed:\n%s", key, row["context"], traceback.format_exc())
        row.setdefault("errors", {})[key] = f"{type(error).__name__}: {error}"[:500]
        return None
    row[key] = value
    return value


SWEEP_STEPS = ("indexer", "attend", "sized", "merge")


def sweep(
    layer: Layer, steps: Sequence[str] = SWEEP_STEPS
) -> tuple[IndexTuning, AttentionConfig, list[dict[str, Any]]]:
    """Time each candidate config on ``layer``; return the fastest indexer and attention configs.

    Block-major goes in three steps, each timing the part its knobs change: the kernel configs on
    the attention kernels alone (one prebuilt plan each), then work-item size x workspace on the
    whole call, then the merge launch on the merges alone.  A step not in ``steps`` keeps its
    first (default) config untimed."""
    results: list[dict[str, Any]] = []
    context = len(layer.q)

    def fastest(kernel: str, configs: list, timed: Callable[[Any], Callable[[], Any]]) -> Any:
        if kernel.rsplit(maxsplit=1)[-1] not in steps:
            return configs[0]
        best, best_ms = configs[0], math.inf
        for config in configs:
            entry = {"kernel": kernel, "config": describe(config), "context": context}
            ms = attempt(entry, "ms", lambda c=config: time_ms(timed(c)))
            results.append(entry)
            logger.info("sweep %s %s: %s ms", kernel, entry["config"], ms)
            if ms is not None and ms < best_ms:
                best, best_ms = config, ms
        return best

    best_index = fastest("indexer", INDEX_CONFIGS, lambda c: lambda: layer.index(c))
    selection = layer.index(best_index)
    out = torch.empty_like(layer.q)

    def attend_phase(config: AttentionConfig) -> Callable[[], Any]:
        plan = layer.plan(selection, config)
        return lambda: layer.attend_chunks(plan)

    def merge_phase(config: AttentionConfig) -> Callable[[], Any]:
        plan = layer.plan(selection, config)
        layer.attend_chunks(plan)
        return lambda: layer.merge_chunks(plan, selection, out)

    best = fastest("block_major attend", [AttentionConfig(t) for t in BLOCK_MAJOR_CONFIGS], attend_phase)
    sized = [
        AttentionConfig(dataclasses.replace(best.tuning, queries_per_item=tiles * best.tuning.tile_tokens), workspace)
        for tiles in TILES_PER_ITEM
        for workspace in WORKSPACES
    ]
    best = fastest("block_major sized", sized, lambda c: lambda: layer.attend(selection, "block_major", c))
    merges = [
        dataclasses.replace(
            best, tuning=dataclasses.replace(best.tuning, merge_num_warps=w, merge_num_stages=s, merge_tokens=t)
        )
        for w, s, t in MERGE_CONFIGS
    ]
    return best_index, fastest("block_major merge", merges, merge_phase), results


def measure_fp8_indexer(layer: Layer, row: dict[str, Any], selection: torch.Tensor, tuning: IndexTuning) -> float:
    """The indexer over the engine's fp8 k-index (``--index-dtype fp8_e4m3``) of the same keys; its selections'
    overlap with the bf16 index's (``fp8_selection_overlap``)."""
    keys, scales = fp8_index_from(layer.index_key_cache)

    def index() -> torch.Tensor:
        return prefill_index_topk(layer.index_q, keys, layer.metadata, TOPK, LOCAL, tuning, index_key_scale=scales)

    shared, held = reference.selection_overlap(selection, index())
    row["fp8_selection_overlap"] = shared / max(held, 1)
    return time_ms(index)


def measure_peer(layer: Layer, peer: msa_peer.Peer, row: dict[str, Any], selection: torch.Tensor,
                 attn: AttentionConfig) -> float:  # fmt: skip
    """The peer's prefill layer (index scores, top-k, sparse attention; eager, as vLLM runs prefill) over the same
    inputs, timed as ours.  Up to 32K its selection and output are compared with ours."""
    dims = msa_peer.PeerDims(num_kv_heads=KV_HEADS, topk=TOPK, local_blocks=LOCAL, scale=SCALE)
    context = len(layer.q)
    kv = msa_peer.interleaved_kv(layer.key_cache, layer.value_cache)
    buffer = msa_peer.topk_buffer(context, KV_HEADS, TOPK, layer.q.device)
    out = torch.empty_like(layer.q)
    msa_peer.reset_autotune(peer)

    def run() -> torch.Tensor:
        return msa_peer.prefill_layer(peer, dims, layer.index_q, layer.index_key_cache, layer.q, kv,
                                      layer.metadata.page_table, buffer, out)  # fmt: skip

    ms = time_ms(run)
    if context <= 32768:
        peer_selection = run().sort(dim=-1).values
        row["peer_same_selection_frac"] = float(
            (peer_selection == selection.sort(dim=-1).values).all(-1).float().mean()
        )
        ours = layer.attend(selection, "block_major", attn)
        row["peer_max_abs_diff"] = float((out.float() - ours.float()).abs().max())
    return ms


def measure(layer: Layer, index_tuning: IndexTuning, attn: AttentionConfig, dense: bool,
            peer: msa_peer.Peer | None = None) -> dict[str, Any]:  # fmt: skip
    context = len(layer.q)
    row: dict[str, Any] = {"context": context}
    selection = layer.index(index_tuning)
    torch.cuda.synchronize()
    attempt(row, "indexer_ms", lambda: time_ms(lambda: layer.index(index_tuning)))
    measure_phases(row, layer, selection, attn)
    attempt(row, "block_major_ms", lambda: time_ms(lambda: layer.attend(selection, "block_major", attn)))
    attempt(row, "query_major_ms", lambda: time_ms(lambda: layer.attend(selection, "query_major", attn)))
    attempt(
        row, "msa_total_ms",
        lambda: time_ms(lambda: layer.attend(layer.index(index_tuning), "block_major", attn)),
    )  # fmt: skip
    attempt(row, "indexer_peak_mib", lambda: peak_extra_mib(lambda: layer.index(index_tuning)))
    attempt(row, "block_major_peak_mib", lambda: peak_extra_mib(lambda: layer.attend(selection, "block_major", attn)))
    add_rates(row, layer, selection)
    if context <= 32768:  # the two attention methods agree on the same selection (bf16 rounding)
        attempt(
            row, "block_vs_query_max_abs_diff",
            lambda: float((layer.attend(selection, "block_major", attn).float()
                           - layer.attend(selection, "query_major", attn).float()).abs().max()),
        )  # fmt: skip
    attempt(row, "indexer_fp8_ms", lambda: measure_fp8_indexer(layer, row, selection, index_tuning))
    if peer is not None:
        attempt(row, "peer_ms", lambda: measure_peer(layer, peer, row, selection, attn))
    if dense:
        attempt(row, "flashinfer_ms", lambda: time_ms(dense_flashinfer(layer)))
        attempt(row, "sdpa_flash_ms", lambda: time_ms(dense_sdpa(layer)))
        candidates = [row[k] for k in ("flashinfer_ms", "sdpa_flash_ms") if row.get(k)]
        row["dense_ms"] = min(candidates) if candidates else None
    return row


def measure_phases(row: dict[str, Any], layer: Layer, selection: torch.Tensor, attn: AttentionConfig) -> None:
    """Block-major's phases apart, and the shape of its work: chunks, items, tiles per item."""
    plan = layer.plan(selection, attn)
    out = torch.empty_like(layer.q)
    attempt(row, "csr_ms", lambda: time_ms(lambda: layer.plan(selection, attn)))
    attempt(row, "attend_ms", lambda: time_ms(lambda: layer.attend_chunks(plan)))
    attempt(row, "merge_ms", lambda: time_ms(lambda: layer.merge_chunks(plan, selection, out)))
    items = plan.csr.items[plan.csr.items[:, int(ITEM_HEAD)] >= 0]
    row["chunks"], row["work_items"] = plan.num_chunks, len(items)
    tiles = (items[:, int(ITEM_END)] - items[:, int(ITEM_FIRST)] + plan.tile_tokens - 1) // plan.tile_tokens
    row["tiles_per_item"] = float(tiles.float().mean())


def add_rates(row: dict[str, Any], layer: Layer, selection: torch.Tensor) -> None:
    """Achieved TFLOP/s and TB/s of the timed parts (README: what the bytes count)."""
    pairs, keys = layer.selected_pairs(selection)
    flops = 4.0 * HEAD_DIM * GROUP * keys
    partials = pairs * GROUP * (HEAD_DIM * 2 + 4)  # bf16 partial rows and their fp32 LSEs
    for key in ("block_major", "query_major", "attend"):
        if row.get(f"{key}_ms"):
            row[f"{key}_tflops"] = flops / row[f"{key}_ms"] / 1e9
    if row.get("attend_ms"):  # q rows gathered, partials written, each item's K and V block
        moved = pairs * GROUP * HEAD_DIM * 2 + partials + row["work_items"] * 2 * BLOCK * HEAD_DIM * 2
        row["attend_tbps"] = moved / row["attend_ms"] / 1e9
    if row.get("merge_ms"):  # partials read, output written
        row["merge_tbps"] = (partials + len(layer.q) * Q_HEADS * HEAD_DIM * 2) / row["merge_ms"] / 1e9
    if row.get("indexer_ms"):
        row["indexer_tflops"] = layer.index_flops() / row["indexer_ms"] / 1e9


def compiled_variants() -> list[dict[str, Any]]:
    """Registers, spills and shared memory of every prefill kernel variant this process compiled."""
    rows = []
    for module in (prefill_index, prefill_csr, prefill_block_major, prefill_query_major):
        for name, kernel in vars(module).items():
            if not isinstance(kernel, triton.runtime.JITFunction):
                continue
            for caches in kernel.device_caches.values():
                for entry in list(caches[0].values()):
                    try:
                        compiled = entry.result() if hasattr(entry, "result") else entry
                        constants = {
                            kernel.arg_names[index[0]]: value
                            for index, value in compiled.src.constants.items()
                            if isinstance(value, bool | int) and kernel.arg_names[index[0]].isupper()
                        }
                        rows.append({
                            "kernel": name, "constexprs": " ".join(f"{k}={v}" for k, v in constants.items()),
                            "warps": compiled.metadata.num_warps, "stages": compiled.metadata.num_stages,
                            "registers": compiled.n_regs, "spills": compiled.n_spills,
                            "shared_kib": compiled.metadata.shared / 1024,
                        })  # fmt: skip
                    except Exception as error:  # diagnostics only: never lose the results over them
                        rows.append({"kernel": name, "error": f"{type(error).__name__}: {error}"[:200]})
    return rows


def finish_row(row: dict[str, Any], dense_reference: tuple[int, float] | None) -> None:
    if row.get("dense_ms") is None and dense_reference:
        ref_context, ref_ms = dense_reference
        row["dense_ms_extrapolated"] = ref_ms * (row["context"] / ref_context) ** 2
    dense = row.get("dense_ms") or row.get("dense_ms_extrapolated")
    if dense and row.get("msa_total_ms"):
        row["speedup_vs_dense"] = dense / row["msa_total_ms"]
    if row.get("query_major_ms") and row.get("block_major_ms"):
        row["block_vs_query_speedup"] = row["query_major_ms"] / row["block_major_ms"]
    if row.get("peer_ms") and row.get("msa_total_ms"):
        row["vs_peer"] = row["peer_ms"] / row["msa_total_ms"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for msa_prefill.json (default bench/results)")
    parser.add_argument("--contexts", type=int_list, default=[8192, 32768, 131072, 262144, 1048576])
    parser.add_argument("--budget-s", type=float, default=370.0, help="skip contexts once this much time has passed")
    parser.add_argument("--no-sweep", action="store_true", help="use the default launch configs")
    parser.add_argument(
        "--sweep-steps",
        default=",".join(SWEEP_STEPS),
        help=f"which sweep steps run (of {','.join(SWEEP_STEPS)}); the others keep their defaults",
    )
    parser.add_argument("--table", type=Path, default=None, help="print the tables of a results file and exit")
    parser.add_argument("--no-peer", action="store_true", help="skip the reference stack's kernels (bench.msa_peer)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.table is not None:
        payload = json.loads(args.table.read_text())
        print_tables(payload["rows"], payload.get("sweep", []), payload.get("compiled", []))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("bench.msa_prefill needs a CUDA GPU")
    started = time.monotonic()
    contexts = args.contexts
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {"dims": dict(Hq=Q_HEADS, Hkv=KV_HEADS, D=HEAD_DIM, d=INDEX_DIM, B=BLOCK, K=TOPK)}
    peer = None if args.no_peer else msa_peer.load_peer()
    extra["peer"] = peer.describe() if peer is not None else None
    index_tuning, attn_config = IndexTuning(), AttentionConfig()
    if not args.no_sweep and SWEEP_CONTEXT in contexts:
        layer = Layer(SWEEP_CONTEXT, seed=0, device=torch.device("cuda"))
        try:
            index_tuning, attn_config, extra["sweep"] = sweep(layer, args.sweep_steps.split(","))
        except Exception:
            logger.error("sweep failed, using defaults:\n%s", traceback.format_exc())
        del layer
        torch.cuda.empty_cache()
        logger.info("sweep done after %.0f s", time.monotonic() - started)
    extra["index_tuning"], extra["attention_tuning"] = describe(index_tuning), describe(attn_config)
    dense_reference = None
    for context in contexts:
        elapsed = time.monotonic() - started
        # The contexts past the dense range take the longest (~1 min at 1M): start them early enough.
        if elapsed > args.budget_s or (context > DENSE_MAX_CONTEXT and elapsed > 0.6 * args.budget_s):
            rows.append({"context": context, "skipped": f"{elapsed:.0f}s of the {args.budget_s:.0f}s budget spent"})
            continue
        logger.info("context %d", context)
        try:
            layer = Layer(context, seed=context, device=torch.device("cuda"))
            row = measure(layer, index_tuning, attn_config, dense=context <= DENSE_MAX_CONTEXT, peer=peer)
        except Exception as error:
            logger.error("context %d failed:\n%s", context, traceback.format_exc())
            row = {"context": context, "errors": {"setup": f"{type(error).__name__}: {error}"[:500]}}
        layer = None
        torch.cuda.empty_cache()
        if row.get("dense_ms"):
            dense_reference = (context, row["dense_ms"])
        finish_row(row, dense_reference)
        rows.append(row)
        logger.info("%s", row)
        extra["compiled"] = compiled_variants()
        write_results("msa_prefill", rows, extra, out_dir=args.out)
    extra["compiled"] = compiled_variants()
    write_results("msa_prefill", rows, extra, out_dir=args.out)
    print_tables(rows, extra.get("sweep", []), extra["compiled"])
    return 0


COLUMNS = ["context", "indexer_ms", "csr_ms", "attend_ms", "merge_ms", "block_major_ms", "query_major_ms",
           "msa_total_ms", "dense_ms", "dense_ms_extrapolated", "speedup_vs_dense", "block_vs_query_speedup",
           "attend_tflops", "attend_tbps", "merge_tbps", "indexer_tflops", "tiles_per_item", "indexer_fp8_ms",
           "fp8_selection_overlap", "peer_ms", "vs_peer"]  # fmt: skip
COMPILED_COLUMNS = ["kernel", "constexprs", "warps", "stages", "registers", "spills", "shared_kib", "error"]


def print_tables(rows: list[dict[str, Any]], sweep_rows: list[dict[str, Any]], compiled: list[dict[str, Any]]) -> None:
    """Compiled variants, the sweep, then the results table last: the GPU run's reply shows the tail."""
    tables = [markdown_table(compiled, COMPILED_COLUMNS)] if compiled else []
    if sweep_rows:
        tables.append(markdown_table(sweep_rows, ["kernel", "config", "ms"]))
    tables.append(markdown_table(rows, COLUMNS))
    sys.stdout.write("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
