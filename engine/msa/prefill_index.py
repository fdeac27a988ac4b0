"""MSA prefill indexer: block scores of a chunk of query tokens against all keys of their request,
block max and top-K fused in one Triton kernel.

Semantics are those of ``reference.index_block_topk`` (and HF ``MiniMaxM3VLIndexer``): for a query
at position ``p`` in block ``q = p // B``, the ``n_local = min(local_blocks, q + 1)`` blocks ending at
``q`` are always kept; the other ``topk - local_blocks`` slots go to the best of the earlier blocks
``b < q - n_local + 1`` by ``max_j <index_q[t, h], index_k[j]>`` over the block's keys (ties to the
lower block id).  Ranked blocks are never partially visible, so no causal mask is needed.

Selection layout (shared with ``prefill_attention``): ``[Hidx, T, topk]`` int32, head-major, logical
block ids of the token's request (the kernels translate them through ``page_table``).  Each row is
the ranked blocks best first, then the local blocks ascending (the query's own block LAST), then -1.

Memory: one program owns ``tile_tokens`` tokens x all index heads (packed into the MMA M dimension)
and streams its request's key pages once, keeping each row's running top-K in registers.  No
score tensor is ever written: peak extra memory is the output alone, plus, when the key range is
split across programs (few query tiles, long context: T below 2 x SMs x tile_tokens), ``splits x
Hidx x T x next_pow2(topk) x 8`` bytes of candidates.
"""

import dataclasses
import math

import torch
import triton
import triton.language as tl

from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import FP8_INDEX_DTYPE, check_index_scale, dequantize_index_keys
from m3stack.engine.msa.launch import multiprocessors, use_triton
from m3stack.engine.msa.prefill_common import NEG_INF
from m3stack.engine.msa.prefill_plan import check_paged_layout, token_tiles


@dataclasses.dataclass(frozen=True)
class IndexTuning:
    """Launch parameters of the indexer; ``None`` picks a default from the shapes and the device."""

    tile_tokens: int | None = None
    key_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


# fmt: off
@triton.jit
def _topk_insert(st_score, st_id, new_score, new_id):
    """Offer one candidate per row to a running top-K (``[M, KP]`` scores and ids, ids unique).

    The worst entry is the lowest score, ties broken towards the highest id; a candidate replaces
    it if it scores higher, or equal with a lower id, so the kept set is the exact top-K with ties
    to the lower id whatever order candidates arrive in.  Candidates scoring -inf are dropped.
    """
    worst = tl.min(st_score, axis=1)
    worst_id = tl.max(tl.where(st_score == worst[:, None], st_id, -2147483647), axis=1)
    better = ((new_score > worst) | ((new_score == worst) & (new_id < worst_id))) & (new_score > NEG_INF)
    replace = better[:, None] & (st_id == worst_id[:, None])
    st_score = tl.where(replace, new_score[:, None], st_score)
    st_id = tl.where(replace, new_id[:, None], st_id)
    return st_score, st_id


@triton.jit
def _topk_init(M: tl.constexpr, KP: tl.constexpr, K_RANK: tl.constexpr):
    """Empty state: the first ``K_RANK`` slots hold -inf with distinct negative ids (so they fill
    left to right), the padding slots hold +inf so they are never evicted."""
    slot = tl.arange(0, KP)[None, :] + tl.zeros((M, KP), dtype=tl.int32)
    st_score = tl.where(slot < K_RANK, tl.full((M, KP), NEG_INF, tl.float32), float("inf"))
    return st_score, -1 - slot


@triton.jit
def _store_selection(
    out_ptr, row_offset, row_mask, st_score, st_id, first_local, num_local,
    K: tl.constexpr, KP: tl.constexpr, K_RANK: tl.constexpr,
):
    """Write rows ``[ranked best first, local blocks ascending, -1 ...]`` of ``K`` int32 columns."""
    slot = tl.arange(0, KP)[None, :]
    valid = (st_id >= 0) & (slot < K_RANK)
    num_valid = tl.sum(valid.to(tl.int32), axis=1)
    # The output column of a valid entry is the number of valid entries that beat it; one column
    # of competitors at a time keeps this in [M, KP] registers.
    rank = tl.zeros_like(st_id)
    for j in tl.static_range(K_RANK):
        score_j = tl.sum(tl.where(slot == j, st_score, 0.0), axis=1)[:, None]
        id_j = tl.sum(tl.where(slot == j, st_id, 0), axis=1)[:, None]
        beats = (id_j >= 0) & ((score_j > st_score) | ((score_j == st_score) & (id_j < st_id)))
        rank += beats.to(tl.int32)
    tl.store(out_ptr + row_offset[:, None] + rank, st_id, mask=row_mask[:, None] & valid)
    tail = slot - num_valid[:, None]
    tail_value = tl.where(tail < num_local[:, None], first_local[:, None] + tail, -1)
    tl.store(out_ptr + row_offset[:, None] + slot, tail_value, mask=row_mask[:, None] & (tail >= 0) & (slot < K))


@triton.jit
def _tile_rows(
    tile_ptr, positions_ptr, n_tiles,
    H: tl.constexpr, HP: tl.constexpr, TILE: tl.constexpr, B: tl.constexpr, LOCAL: tl.constexpr,
):
    """The ``TILE * HP`` rows of this program's tile (token-major, index head minor), their local
    window, and where each row's selection goes in the ``[H, T, K]`` output (row offset / K)."""
    tile = tl.program_id(0)
    request = tl.load(tile_ptr + tile)
    first_row = tl.load(tile_ptr + n_tiles + tile)
    end_row = tl.load(tile_ptr + 2 * n_tiles + tile)
    m = tl.arange(0, TILE * HP)
    token = (first_row + m // HP).to(tl.int64)
    head = m % HP
    row_mask = (token < end_row) & (head < H)
    q_block = (tl.load(positions_ptr + token, mask=row_mask, other=0) // B).to(tl.int32)
    num_local = tl.minimum(q_block + 1, LOCAL)
    return request, token, head, row_mask, q_block - num_local + 1, num_local


# Counts and widths that change from step to step stay unspecialized: Triton would otherwise compile a
# variant per value class (1, multiples of 16, others) the first time a step meets it, mid-serving.
# The number of key splits follows the step's query tiles, so it is a runtime value too: only whether the
# keys are split at all (where the top-K goes) is compiled in.
@triton.jit(do_not_specialize=["n_tiles", "n_tokens", "blocks_per_split", "stride_pt"])
def _index_topk_kernel(
    q_ptr, key_ptr, page_table_ptr, positions_ptr, tile_ptr, out_ptr, cand_score_ptr, cand_id_ptr,
    n_tiles, n_tokens, blocks_per_split, stride_qt, stride_qh, stride_kp, stride_kb, stride_pt,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, B: tl.constexpr, TILE: tl.constexpr,
    K: tl.constexpr, KP: tl.constexpr, LOCAL: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    K_RANK: tl.constexpr = K - LOCAL
    split = tl.program_id(1)
    request, token, head, row_mask, first_local, num_local = _tile_rows(
        tile_ptr, positions_ptr, n_tiles, H, HP, TILE, B, LOCAL)
    d = tl.arange(0, DP)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & (d[None, :] < D), other=0.0)
    # Ranked candidates are the blocks below each row's local window: always fully visible.
    block_end = tl.max(tl.where(row_mask, first_local, 0), axis=0)
    block_lo = split * blocks_per_split
    block_hi = tl.minimum(block_lo + blocks_per_split, block_end)
    st_score, st_id = _topk_init(TILE * HP, KP, K_RANK)
    key_offsets = tl.arange(0, B)[:, None] * stride_kb + d[None, :]
    page_row = page_table_ptr + request.to(tl.int64) * stride_pt
    # The next block's page id is loaded one block ahead, so the key load's address comes from the
    # previous iteration and the software pipeliner can issue it num_stages - 1 blocks early (an
    # indirection inside the iteration would cost it a stage).
    page = tl.load(page_row + block_lo, mask=block_lo < block_hi, other=0)
    for block in range(block_lo, block_hi):
        next_page = tl.load(page_row + block + 1, mask=block + 1 < block_hi, other=0)
        keys = tl.load(key_ptr + page.to(tl.int64) * stride_kp + key_offsets, mask=d[None, :] < D, other=0.0)
        block_max = tl.max(tl.dot(q, tl.trans(keys), input_precision=INPUT_PRECISION), axis=1)
        block_max = tl.where(block < first_local, block_max, NEG_INF)
        st_score, st_id = _topk_insert(st_score, st_id, block_max, tl.zeros_like(first_local) + block)
        page = next_page
    if not SPLIT_KEYS:
        row_offset = (head * n_tokens + token) * K
        _store_selection(out_ptr, row_offset, row_mask, st_score, st_id, first_local, num_local, K, KP, K_RANK)
    else:  # candidates [num_splits, H, T, KP] for the merge kernel
        slot = tl.arange(0, KP)[None, :]
        cand = ((split * H + head) * n_tokens + token)[:, None] * KP + slot
        keep = row_mask[:, None] & (slot < K_RANK)
        tl.store(cand_score_ptr + cand, st_score, mask=keep)
        tl.store(cand_id_ptr + cand, st_id, mask=keep)


@triton.jit(do_not_specialize=["n_tiles", "n_tokens", "num_splits"])
def _index_topk_merge_kernel(
    positions_ptr, tile_ptr, out_ptr, cand_score_ptr, cand_id_ptr, n_tiles, n_tokens, num_splits,
    H: tl.constexpr, HP: tl.constexpr, B: tl.constexpr, TILE: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    LOCAL: tl.constexpr,
):
    """Merge the per-split top-K candidates of one tile's rows and write the final selection."""
    K_RANK: tl.constexpr = K - LOCAL
    _, token, head, row_mask, first_local, num_local = _tile_rows(
        tile_ptr, positions_ptr, n_tiles, H, HP, TILE, B, LOCAL)
    st_score, st_id = _topk_init(TILE * HP, KP, K_RANK)
    for split in range(num_splits):
        base = ((split * H + head) * n_tokens + token) * KP
        for slot in range(K_RANK):
            cand_score = tl.load(cand_score_ptr + base + slot, mask=row_mask, other=NEG_INF)
            cand_id = tl.load(cand_id_ptr + base + slot, mask=row_mask, other=-1)
            st_score, st_id = _topk_insert(st_score, st_id, cand_score, cand_id)
    row_offset = (head * n_tokens + token) * K
    _store_selection(out_ptr, row_offset, row_mask, st_score, st_id, first_local, num_local, K, KP, K_RANK)
# fmt: on


def _check_inputs(
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor,
    metadata: AttentionMetadata,
    topk: int,
    local_blocks: int,
    index_key_scale: torch.Tensor | None,
) -> None:
    if index_q.dim() != 3:
        raise ValueError(f"index_q must be [T, Hidx, d], got shape {tuple(index_q.shape)}")
    if index_key_cache.dim() != 3:
        raise ValueError(f"index_key_cache must be [num_pages, block_size, d], got {tuple(index_key_cache.shape)}")
    num_tokens, _, head_dim = index_q.shape
    _, block_size, key_dim = index_key_cache.shape
    if key_dim != head_dim:
        raise ValueError(f"index_q has head dim {head_dim} but index_key_cache has {key_dim}")
    check_paged_layout(block_size, num_tokens, metadata, "index_key_cache")
    if not 1 <= local_blocks <= topk:
        raise ValueError(f"need 1 <= local_blocks <= topk, got local_blocks={local_blocks}, topk={topk}")
    if index_key_cache.dtype not in (index_q.dtype, FP8_INDEX_DTYPE):
        raise ValueError(f"index_q is {index_q.dtype} but index_key_cache is {index_key_cache.dtype}")
    check_index_scale(index_key_cache, index_key_scale)
    if index_key_cache.dtype == FP8_INDEX_DTYPE and index_key_scale is None:
        raise ValueError("an fp8 index_key_cache needs its index_key_scale")
    if len({index_q.device, index_key_cache.device, metadata.positions.device}) != 1:
        raise ValueError("index_q, index_key_cache and metadata must be on one device")
    if not use_triton(index_q):
        raise ValueError("prefill_index_topk runs Triton kernels: it needs CUDA tensors (or TRITON_INTERPRET=1)")
    if index_q.stride(-1) != 1 or index_key_cache.stride(-1) != 1 or index_key_cache.stride(1) != key_dim:
        raise ValueError("index_q and index_key_cache need a contiguous last dimension (and contiguous page rows)")


def _dequantized_pages(
    index_key_cache: torch.Tensor, index_key_scale: torch.Tensor, metadata: AttentionMetadata, dtype: torch.dtype
) -> tuple[torch.Tensor, AttentionMetadata]:
    """The step's requests' pages of an fp8 k-index dequantized to the queries' dtype in a scratch (``key * scale``,
    so the kernel scores them as a bf16 k-index), with a page table over it.  This indexer is compute-bound (every
    query tile scores every key block before it): widening each tile inside the kernel cost a shared-memory round
    trip per tile (29.3 ms against 16.0 for a bf16 k-index at 128K on the H200, 2026-12-04), and scaling the scores
    there 165 registers a thread, one CTA per SM (25.7 ms); once per step it is a copy of the requests' pages (32 MiB
    at 128K).  Rounding ``key * scale`` to bf16 adds 2^-9 of relative error to e4m3's 2^-4."""
    block_size = index_key_cache.shape[1]
    width = int((metadata.seq_lens_cpu.max() + block_size - 1) // block_size)
    pages = metadata.page_table[:, :width].long().flatten()
    keys = dequantize_index_keys(index_key_cache[pages], index_key_scale[pages]).to(dtype)
    table = torch.arange(pages.numel(), dtype=torch.int32, device=pages.device).view(-1, width)
    return keys, dataclasses.replace(metadata, page_table=table)


def default_key_splits(num_tiles: int, max_blocks: int, device: torch.device) -> int:
    """Split the key range only when the query tiles alone cannot fill the GPU (short chunk, long
    context): as many splits as keep the programs within one wave of two per SM (the default
    config's occupancy), each scanning at least 64 blocks."""
    slots = 2 * multiprocessors(device)
    return max(1, min(slots // max(num_tiles, 1), max_blocks // 64, 32))


def index_launch(tuning: IndexTuning) -> dict[str, int]:
    """Launch options of the index kernel.  Default: two CTAs per SM (sm_90, Triton 3.6: 128
    registers, 96 KiB of shared memory), each prefetching the next key block while the other
    computes; 3 stages prefetch two blocks ahead but fit one CTA per SM (bench.msa_prefill sweeps both)."""
    return dict(num_warps=tuning.num_warps or 8, num_stages=tuning.num_stages or 2)


def prefill_index_topk(
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor,
    metadata: AttentionMetadata,
    topk: int,
    local_blocks: int,
    tuning: IndexTuning | None = None,
    index_key_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """MSA block selection for every new token of a step: ``[Hidx, T, topk]`` int32 (module docstring).

    ``index_q`` ``[T, Hidx, d]``: the indexer's queries after norm and RoPE.  ``index_key_cache``
    ``[num_pages, block_size, d]``: the layer's index keys, already holding the new tokens' keys (fp8 e4m3 with
    ``index_key_scale`` ``[num_pages, block_size]``: keys stored divided by their per-token scale).
    """
    _check_inputs(index_q, index_key_cache, metadata, topk, local_blocks, index_key_scale)
    tuning = tuning or IndexTuning()
    num_tokens, num_heads, head_dim = index_q.shape
    block_size = metadata.block_size
    device = index_q.device
    out = torch.empty((num_heads, num_tokens, topk), dtype=torch.int32, device=device)
    if num_tokens == 0:
        return out
    if index_key_scale is not None:
        index_key_cache, metadata = _dequantized_pages(index_key_cache, index_key_scale, metadata, index_q.dtype)
    heads_padded = triton.next_power_of_2(num_heads)
    # TILE * HP rows per program: 128 for M3 (32 tokens x 4 heads), at least 16 for tl.dot.
    tile_tokens = max(tuning.tile_tokens or 128 // heads_padded, triton.cdiv(16, heads_padded))
    tiles = token_tiles(metadata, tile_tokens, device)
    max_blocks = int((metadata.seq_lens_cpu.max() + block_size - 1) // block_size)  # bounds every row's blocks
    num_splits = tuning.key_splits or default_key_splits(tiles.count, max_blocks, device)
    blocks_per_split = math.ceil(max_blocks / num_splits)
    slots_padded = triton.next_power_of_2(topk)
    if num_splits > 1:
        cand_shape = (num_splits, num_heads, num_tokens, slots_padded)
        cand_score = torch.empty(cand_shape, dtype=torch.float32, device=device)
        cand_id = torch.empty(cand_shape, dtype=torch.int32, device=device)
    else:
        cand_score = cand_id = out  # unused by the kernel
    shape_args = dict(
        H=num_heads, HP=heads_padded, B=block_size, TILE=tile_tokens, K=topk, KP=slots_padded, LOCAL=local_blocks
    )
    launch = index_launch(tuning)
    _index_topk_kernel[(tiles.count, num_splits)](
        index_q, index_key_cache, metadata.page_table, metadata.positions, tiles.table,
        out, cand_score, cand_id,
        tiles.count, num_tokens, blocks_per_split,
        index_q.stride(0), index_q.stride(1), index_key_cache.stride(0), index_key_cache.stride(1),
        metadata.page_table.stride(0),
        D=head_dim, DP=max(16, triton.next_power_of_2(head_dim)), SPLIT_KEYS=num_splits > 1,
        INPUT_PRECISION="ieee" if index_q.dtype == torch.float32 else "tf32",
        **shape_args, **launch,
    )  # fmt: skip
    if num_splits > 1:
        _index_topk_merge_kernel[(tiles.count,)](
            metadata.positions, tiles.table, out, cand_score, cand_id, tiles.count, num_tokens, num_splits,
            num_warps=8, **shape_args,
        )  # fmt: skip
    return out
