"""MSA decode index scoring + block top-k: one Triton launch, no score tensor in memory.

Semantics are ``reference.index_block_topk`` (HF ``MiniMaxM3VLIndexer``), for every new token of a
decode step (one or a few per request).  The cost is the k-index read: ``context x d x bytes`` per
request and layer (1M tokens, bf16: 256 MiB, ~60 us on an H200), so the kernel streams each
request's index pages exactly once, at full bandwidth, and does everything else on the fly:

1. Scan, grid ``(splits, R)`` (``(R, splits)`` split-major): program ``(s, r)`` streams the ``s``-th slice
   of request ``r``'s candidate pages (the pages before its last token's local blocks).  Per page it computes
   ``keys [B, d] @ q [d, N]`` on the tensor cores (keys as the MMA M dimension; the N columns are
   the request's (token, index head) pairs), reduces each column to the block max, and offers it to
   a running top-K per column held in registers.  Each program leaves its K candidates per column
   (a list) and their best one (the list's head) in small buffers.  The local block(s) are never
   read: they are always kept.
2. Merge, in the LAST scan program of each request to finish (a per-request atomic ticket counter,
   reset by that program, so no extra launch and no memset): of the ``splits`` lists, only those
   whose heads rank among the best ``topk - local`` heads can hold a selected block (any other
   list's head already has that many better candidates above it), so the merge ranks the heads,
   gathers those few lists and ranks their entries.  It appends the local blocks and writes the
   selection twice: logical block ids ``[Hidx, T, topk]`` (head-major, ``-1`` padded, as in the
   reference) and the virtual page ids the paged attention reads (``SparseDecodePlan.page_ids``,
   local page last).  Steps with many columns per request (MTP) merge in a second launch instead,
   one program per group of columns.

Scores and block ids travel packed in one int64 (order-preserving float bits high, inverted id
low), so "higher score, then lower block id" is a single integer comparison: ties go to the lower
block id exactly as in the reference, across splits as well as within one.

The k-index may be fp8 (e4m3): half the scan's bytes; the keys are widened (through fp16) to the queries'
type in registers, so the scores are exact products of the stored keys.

With ``store`` (decode steps of one token per request), the scan's first program of each request
also writes the step's new K, V and index key into the paged cache (``msa.store``): that token
sits in the request's last block, which is local and so never scanned, and the attention that
reads it is a later launch.  That saves the store's own launch.

The kernels are in ``decode_index_kernels``; this module checks the inputs, sizes the lists and the merge, and
launches them.
"""

from dataclasses import dataclass

import torch
import triton

from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import LayerKVCache, check_index_scale
from m3stack.engine.msa.decode_index_kernels import FLOOR, merge_kernel, scan_kernel, shared_scan_kernel
from m3stack.engine.msa.decode_plan import SparseDecodePlan, SparseDecodeShape
from m3stack.engine.msa.launch import pdl_available, pdl_launch
from m3stack.engine.msa.store import check_store_inputs, store_launch_args


@dataclass(frozen=True)
class ScanConfig:
    """Launch shape of the index scan (bench/msa_decode.py sweeps these on the H200)."""

    # Index pages per MMA ([pages * B, d] @ [d, N]).  One 32 KiB bf16 page per step keeps a program at
    # ~70 KiB of shared memory (double-buffered), so three programs share each H200 SM.
    pages_per_iteration: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # Merge in the scan's last program per request (one launch) rather than in a second launch.
    fused_merge: bool = True
    # Load the next iteration's page ids during this one, so a key tile's address never waits on a load of
    # the same iteration (the prefill indexer's fix for Triton's pipeliner); off until the H200 sweep says.
    page_ids_ahead: bool = False
    # Launch order: the same split of every request side by side, instead of every split of one request.  Requests
    # that share prefix pages (agentic serving: one long prefix, many requests) then read each page while the other
    # requests' programs for it are resident, from L2 rather than HBM; other batches read what they read before.
    split_major: bool = False
    # Warps of the merge's own launch (``fused_merge`` off): at one, its 30 sequential rankings reduce within
    # a warp, with no shared-memory round trip and barrier each; it ranks 512 keys a program per warp.  Lists of
    # fewer than 16 slots are merged by 4 warps whatever this says (``_FEW_WARP_MERGE_MIN_SLOTS``).
    merge_warps: int = 4
    # Scan pages that several requests share (one agentic prefix) once for all of them: a program scores a split's
    # key tiles for up to ``shared_group`` consecutive requests whose page tables hold the same pages over that
    # split, in the MMA columns one decode request leaves unused (1 token x 4 index heads of 16).  Splits then
    # cover the same blocks in every request (sized from the page table's width), and the merge is its own launch.
    shared_pages: bool = False
    shared_group: int = 4
    # Launch what follows the scan (the merge, the attention) with programmatic dependent launch where the device
    # has it (sm_90+, not the interpreter): the scan lets the next grid start at once, whose programs load what
    # the scan does not write and then wait for it, so the ~3-5 us launch and ramp of each dependent kernel
    # overlap the scan instead of following it.
    pdl: bool = True

    def __post_init__(self) -> None:
        if self.merge_warps not in (1, 2, 4, 8):
            raise ValueError(f"merge_warps must be 1, 2, 4 or 8, got {self.merge_warps}")
        if self.shared_group < 1 or self.shared_group & (self.shared_group - 1) or self.shared_group > 16:
            raise ValueError(f"shared_group must be a power of two from 1 to 16, got {self.shared_group}")


# Columns of the scan's MMA: at least 16 (tensor-core minimum); (tokens x index heads) beyond
# this many per request go to the prefill path instead.
MAX_DECODE_COLUMNS = 64
# Fewest columns the lists and the merge are laid out for.  A merge program of 2 columns faults with an illegal
# address on the H200: a TP=2 rank's 2 index heads x 1 decode token (the 2x H200 engine's fault, repro on one GPU,
# 2026-12-01), and a two-warp merge launch ranking 2 of 4 columns at 512 splits (the H200 sweep, the same day);
# 1, 4 and 16 run clean.  The padding columns belong to no token and are never stored.
_MIN_MERGE_COLUMNS = 4
# Int64 keys a merge program ranks at once (heads of all splits x its columns) per warp: 16 per thread.
# More columns than fit the scan's program (4 warps) are merged in a second launch.
_MERGE_KEYS_PER_WARP = 512
# Page ids two requests' rows are compared in at once (``ScanConfig.shared_pages``).
_PAGE_COMPARE_CHUNK = 32
_FUSED_MERGE_WARPS = 4
# Fewest list slots (top-k minus local blocks, to a power of two) a merge launch of fewer than 4 warps is run
# for.  On the H200 (2026-12-01, every split count from 8 to 256), lists of 4 slots (the tiny model's top-4)
# merged by 1 warp select other blocks than 4 warps do, and by 2 warps fault with an illegal address; M3's 16
# slots merge identically at 1, 2 and 4 warps, also at a TP=2 rank's 2 index heads.
_FEW_WARP_MERGE_MIN_SLOTS = 16


def check_decode_inputs(index_q: torch.Tensor, index_key_cache: torch.Tensor, metadata: AttentionMetadata,
                        plan: SparseDecodePlan, index_key_scale: torch.Tensor | None = None) -> None:  # fmt: skip
    shape = plan.shape
    if index_q.shape != (metadata.num_tokens, shape.num_kv_heads, shape.index_head_dim):
        raise ValueError(
            f"index_q has shape {tuple(index_q.shape)}, expected "
            f"({metadata.num_tokens}, {shape.num_kv_heads}, {shape.index_head_dim}) (index heads = KV heads)"
        )
    if index_key_cache.dim() != 3 or index_key_cache.shape[1:] != (shape.block_size, shape.index_head_dim):
        raise ValueError(
            f"index_key_cache has shape {tuple(index_key_cache.shape)}, "
            f"expected [num_pages, {shape.block_size}, {shape.index_head_dim}]"
        )
    if index_key_cache.dtype not in (index_q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"index_key_cache must be {index_q.dtype} (as index_q) or float8_e4m3fn, "
                         f"not {index_key_cache.dtype}")  # fmt: skip
    if index_q.stride(-1) != 1 or index_key_cache.stride(-1) != 1:
        raise ValueError("index_q and index_key_cache need a contiguous last dimension")
    check_index_scale(index_key_cache, index_key_scale)
    if shape.num_kv_heads * plan.max_query_len > MAX_DECODE_COLUMNS:
        raise ValueError(
            f"{plan.max_query_len} tokens x {shape.num_kv_heads} index heads per request exceed the decode "
            f"indexer's {MAX_DECODE_COLUMNS} columns: use the prefill indexer"
        )
    if shape.index_head_dim < 16 or shape.index_head_dim & (shape.index_head_dim - 1):
        raise ValueError(f"index_head_dim must be a power of two >= 16, got {shape.index_head_dim}")


@dataclass(frozen=True)
class NewKeys:
    """A decode step's new keys, for the scan to store into ``cache`` (``msa.store.store_kv``'s inputs)."""

    cache: LayerKVCache
    slot_mapping: torch.Tensor  # [T]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    index_k: torch.Tensor  # [T, d]


@dataclass(frozen=True)
class _MergeShape:
    """Host-side sizes of the lists and of the merge (constexprs of both kernels)."""

    columns_stored: int  # CS: (tokens x index heads) per request, padded to a power of two
    list_slots: int  # KP
    splits_padded: int  # SP
    columns_per_program: int  # CPB

    @property
    def fits_one_program(self) -> bool:
        return self.columns_per_program == self.columns_stored


def _list_slots(shape: SparseDecodeShape) -> int:
    """KP: the slots of a scan program's candidate list per column (the ranked blocks, to a power of two)."""
    return triton.next_power_of_2(max(shape.topk - shape.local_blocks, 1))


def _merge_shape(plan: SparseDecodePlan, warps: int) -> _MergeShape:
    shape = plan.shape
    columns = triton.next_power_of_2(max(shape.num_kv_heads * plan.max_query_len, _MIN_MERGE_COLUMNS))
    splits_padded = triton.next_power_of_2(plan.scan_splits)
    per_program = max(1, min(columns, _MERGE_KEYS_PER_WARP * warps // splits_padded))
    if per_program == 2:  # never a 2-column merge program (above): one column each instead
        per_program = 1
    return _MergeShape(columns, _list_slots(shape), splits_padded, per_program)


def merge_constexprs(plan: SparseDecodePlan, merge: _MergeShape) -> dict[str, int]:
    shape = plan.shape
    ranked = max(shape.topk - shape.local_blocks, 1)
    return dict(
        HIDX=shape.num_kv_heads, B=shape.block_size, CS=merge.columns_stored, KP=merge.list_slots,
        SP=merge.splits_padded, TOPK=shape.topk, TOPK_P=triton.next_power_of_2(shape.topk), KR=ranked,
        KR_P=triton.next_power_of_2(ranked), LOCAL=shape.local_blocks, FLOOR=FLOOR,
    )  # fmt: skip


def _store_constexprs(plan: SparseDecodePlan, scaled: bool) -> dict[str, int | bool]:
    """``store_token``'s constexprs for an MSA layer of the plan's shape (its cache always has index keys), whose
    k-index is fp8 with scales or not."""
    shape = plan.shape
    return dict(ST_HKV=shape.num_kv_heads, ST_HKV_P=triton.next_power_of_2(shape.num_kv_heads), ST_D=shape.head_dim,
                ST_D_P=triton.next_power_of_2(shape.head_dim), ST_DI=shape.index_head_dim,
                ST_DI_P=triton.next_power_of_2(shape.index_head_dim), ST_HAS_INDEX=True,
                ST_INDEX_SCALED=scaled)  # fmt: skip


def _store_arguments(
    new_keys: NewKeys | None,
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor,
    index_key_scale: torch.Tensor | None,
    plan: SparseDecodePlan,
    metadata: AttentionMetadata,
) -> tuple[tuple, dict[str, int | bool]]:
    """The scan's store arguments: the real ones with ``new_keys``, else stand-ins of the same types and the same
    constexprs (the scan never reads them), so both cases share one compiled kernel."""
    if new_keys is None:
        scale = index_key_scale if index_key_scale is not None else index_q
        stand_ins = (metadata.slot_mapping, index_q, index_q, index_q, index_q, index_q, index_key_cache, scale)
        return stand_ins + (0,) * 11, _store_constexprs(plan, index_key_scale is not None)
    if not metadata.is_pure_decode:
        raise ValueError("the scan stores new keys only for decode steps of one token per request")
    check_store_inputs(new_keys.cache, new_keys.slot_mapping, new_keys.k, new_keys.v, new_keys.index_k)
    if new_keys.cache.index_key is None:
        raise ValueError("the scan stores into an MSA layer's cache (with index keys)")
    args, constexprs = store_launch_args(new_keys.cache, new_keys.slot_mapping, new_keys.k, new_keys.v,
                                         new_keys.index_k)  # fmt: skip
    if constexprs.pop("B") != plan.shape.block_size:
        raise ValueError("the cache's page size differs from the plan's block size")
    constexprs = {f"ST_{name}": value for name, value in constexprs.items()}
    want = _store_constexprs(plan, index_key_scale is not None)
    if constexprs != want:
        raise ValueError(f"the cache's shape {constexprs} differs from the plan's {want}")
    return args, constexprs


@dataclass
class IndexScan:
    """What ``scan_index_pages`` launched: the per-split lists, and the selection if already merged."""

    lists: torch.Tensor  # [R, splits, CS, KP] int64 packed candidates
    heads: torch.Tensor  # [R, splits, CS] int64, each list's best
    selected: torch.Tensor  # [Hidx, T, topk] int32, filled by the merge
    merged: bool  # the scan's last programs merged (one launch)
    merge: _MergeShape
    merge_warps: int
    uniform_per_split: int = 0  # blocks of every request's splits (shared-page scans), else 0: per request
    pdl: bool = False  # launches after the scan may use programmatic dependent launch (the scan triggers them)


def scan_index_pages(
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor,
    metadata: AttentionMetadata,
    plan: SparseDecodePlan,
    config: ScanConfig | None = None,
    new_keys: NewKeys | None = None,
    index_key_scale: torch.Tensor | None = None,
) -> IndexScan:
    """Step 1 (and step 2 with ``config.fused_merge`` where the columns fit one program): the scan.
    ``index_key_scale`` ``[num_pages, B]`` float32: the fp8 k-index's per-token scales (``kv_cache.tensors``)."""
    check_decode_inputs(index_q, index_key_cache, metadata, plan, index_key_scale)
    if new_keys is not None and (new_keys.cache.index_key is not index_key_cache
                                 or new_keys.cache.index_key_scale is not index_key_scale):  # fmt: skip
        raise ValueError("new_keys.cache must be the cache whose index keys (and scales) are scanned")
    config = config or ScanConfig()
    shape = plan.shape
    num_tokens, num_heads, head_dim = index_q.shape
    store_args, store_constexprs = _store_arguments(new_keys, index_q, index_key_cache, index_key_scale, plan,
                                                    metadata)  # fmt: skip
    scaled = index_key_scale is not None
    key_scale = index_key_scale if scaled else index_q  # a stand-in the kernel never reads
    key_scale_stride = index_key_scale.stride(0) if scaled else 0
    merge_warps = _FUSED_MERGE_WARPS if config.fused_merge else config.merge_warps
    if _list_slots(shape) < _FEW_WARP_MERGE_MIN_SLOTS:
        merge_warps = _FUSED_MERGE_WARPS
    merge = _merge_shape(plan, merge_warps)
    splits = plan.scan_splits
    device = index_q.device
    scan = IndexScan(
        lists=torch.empty((plan.num_requests, splits, merge.columns_stored, merge.list_slots), dtype=torch.int64,
                          device=device),
        heads=torch.empty((plan.num_requests, splits, merge.columns_stored), dtype=torch.int64, device=device),
        selected=torch.empty((num_heads, num_tokens, shape.topk), dtype=torch.int32, device=device),
        merged=config.fused_merge and merge.fits_one_program and not config.shared_pages,
        merge=merge,
        merge_warps=merge_warps,
        pdl=config.pdl and pdl_available(device),
    )  # fmt: skip
    if plan.num_requests == 0:
        return scan
    grid = (plan.num_requests, splits) if config.split_major else (splits, plan.num_requests)
    common = dict(
        D=head_dim, PAGES=config.pages_per_iteration, PAGE_IDS_AHEAD=config.page_ids_ahead,
        SPLIT_MAJOR=config.split_major, INPUT_PRECISION="ieee" if index_q.dtype == torch.float32 else "tf32",
        PDL=scan.pdl, KEY_SCALED=scaled, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if config.shared_pages:
        # Splits sized from the page table's width (fixed for a captured graph), so every request's split s covers
        # the same blocks and one program can serve the requests that share them.
        scan.uniform_per_split = max(1, -(-max(0, metadata.page_table.shape[1] - shape.local_blocks) // splits))
        # Requests a program may serve: at most MAX_DECODE_COLUMNS columns in all, as the per-request scan.
        group = max(1, min(config.shared_group, MAX_DECODE_COLUMNS // merge.columns_stored))
        columns = max(16, merge.columns_stored * group)
        constexprs = merge_constexprs(plan, merge)
        shared_scan_kernel[grid](
            index_q, index_key_cache, key_scale, metadata.page_table, metadata.query_start_loc, metadata.seq_lens,
            scan.lists, scan.heads, index_q.stride(0), index_q.stride(1), index_key_cache.stride(0),
            index_key_cache.stride(1), key_scale_stride, metadata.page_table.stride(0), splits,
            int(new_keys is not None), scan.uniform_per_split, *store_args, HIDX=constexprs["HIDX"],
            B=constexprs["B"], LOCAL=constexprs["LOCAL"], N=columns,
            CS=merge.columns_stored, KP=merge.list_slots, GROUP=group, CHUNK=_PAGE_COMPARE_CHUNK, **common,
            **store_constexprs,
        )  # fmt: skip
        return scan
    scan_kernel[grid](
        index_q, index_key_cache, key_scale, metadata.page_table, metadata.query_start_loc, metadata.seq_lens,
        scan.lists, scan.heads, plan.scan_counters, plan.row_indptr, scan.selected, plan.page_ids,
        index_q.stride(0), index_q.stride(1), index_key_cache.stride(0), index_key_cache.stride(1), key_scale_stride,
        metadata.page_table.stride(0), splits, num_tokens, int(new_keys is not None), *store_args,
        N=max(16, triton.next_power_of_2(num_heads * plan.max_query_len)), MERGE=scan.merged,
        **merge_constexprs(plan, merge), **common, **store_constexprs,
    )  # fmt: skip
    return scan


def merge_selection(scan: IndexScan, metadata: AttentionMetadata, plan: SparseDecodePlan) -> torch.Tensor:
    """Step 2 unless the scan merged: fills ``plan.page_ids``; returns the block ids ``[Hidx, T, topk]``."""
    if scan.merged or plan.num_requests == 0:
        return scan.selected
    merge = scan.merge
    merge_kernel[(plan.num_requests, merge.columns_stored // merge.columns_per_program)](
        scan.lists, scan.heads, metadata.page_table, metadata.query_start_loc, metadata.seq_lens, plan.row_indptr,
        scan.selected, plan.page_ids, metadata.page_table.stride(0), plan.scan_splits, plan.num_tokens,
        scan.uniform_per_split, CPB=merge.columns_per_program, **merge_constexprs(plan, merge), PDL=scan.pdl,
        num_warps=scan.merge_warps, **pdl_launch(scan.pdl),
    )  # fmt: skip
    return scan.selected


def decode_index_topk(
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor,
    metadata: AttentionMetadata,
    plan: SparseDecodePlan,
    config: ScanConfig | None = None,
    new_keys: NewKeys | None = None,
    index_key_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Select every new token's blocks and write their virtual page ids into ``plan.page_ids``.

    ``index_q`` ``[T, Hidx, d]``: the indexer queries after norm and RoPE (Hidx = Hkv);
    ``index_key_cache`` ``[num_pages, B, d]`` holds the context's index keys: this step's too, unless
    ``new_keys`` (pure decode steps only) has the scan store them (and K and V) on the way.  Returns
    the logical block ids ``[Hidx, T, topk]`` int32 (layout of ``reference.index_block_topk``).
    """
    scan = scan_index_pages(index_q, index_key_cache, metadata, plan, config, new_keys, index_key_scale)
    return merge_selection(scan, metadata, plan)
