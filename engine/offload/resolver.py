"""Resolve a decode step's selected blocks against a request's hot buffer: hits, misses, evictions.

After the decode indexer picked each (token, KV head) row's blocks, every selected host block (an id
``>= num_device``, see ``layout``) must be read from a device page.  Per request and MSA layer the hot
buffer is ``H`` device pages (``slot_page``), each remembering the host block it holds
(``slot_block``, -1 when empty) and the step that last used it (``slot_stamp``).  One resolution:

1. the distinct host blocks of the request's rows, in row order (KV head, then rank);
2. a block already in a slot is a hit: the slot is kept;
3. each miss, in that order, takes the least recently used slot that no hit of this step holds
   (oldest stamp, then the lower slot), and a (host slot -> device page) copy is listed;
4. every used slot gets the step's clock as its stamp; every host block's page id is rewritten to its
   slot's page, so the attention reads the same keys and values in the same order as without offload.

There is always a free slot for each miss: one decode token ranks at most ``Hkv * (topk - local)``
blocks, its local blocks stay on the device (``tiered_manager``), and ``H`` is at least that.

``resolve_request`` is the plain-Python statement of these rules (the reference backend uses it, and
the tests hold the kernel to it); ``resolve_decode_pages`` is the Triton kernel the GPU backend runs
over the flattened decode page lists in place, with no host synchronization (CUDA-graph safe).  The
kernel also counts, per MSA layer, hits, misses, and the top-k churn: of the distinct blocks a request
selects, how many it did not select the step before (``hot_buffer.STAT_*`` columns).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3stack.engine.offload.hot_buffer import NUM_STATS, HotStateTensors


@dataclass
class Resolution:
    slots: list[int]  # per entry: the hot slot serving it, -1 for device blocks and empty entries
    copies: list[tuple[int, int]]  # (slot, host block id) to copy in, in miss order
    hits: int


def resolve_request(
    pages: list[int], slot_block: list[int], slot_stamp: list[int], clock: int, num_device: int
) -> Resolution:
    """Resolve one request's entries (page ids, -1 for none); updates ``slot_block`` and ``slot_stamp`` in place."""
    distinct = list(dict.fromkeys(p for p in pages if p >= num_device))
    slot_of = {block: slot for slot, block in enumerate(slot_block) if block >= 0}
    hits = [page for page in distinct if page in slot_of]
    misses = [page for page in distinct if page not in slot_of]
    used = {slot_of[page] for page in hits}
    victims = sorted((s for s in range(len(slot_block)) if s not in used), key=lambda s: (slot_stamp[s], s))
    if len(misses) > len(victims):
        raise RuntimeError(f"{len(distinct)} host blocks in one step exceed the hot buffer's {len(slot_block)} pages")
    copies = []
    for page, slot in zip(misses, victims, strict=False):
        slot_of.pop(slot_block[slot], None)
        slot_block[slot] = page
        slot_of[page] = slot
        copies.append((slot, page))
    for slot in used | {slot for slot, _ in copies}:
        slot_stamp[slot] = clock
    return Resolution([slot_of[p] if p >= num_device else -1 for p in pages], copies, len(hits))


def churn(pages: list[int], previous: list[int]) -> tuple[int, int]:
    """(distinct selected blocks, how many of them ``previous`` lacks); (0, 0) without a previous selection."""
    if not any(p >= 0 for p in previous):
        return 0, 0
    distinct = {p for p in pages if p >= 0}
    return len(distinct), len(distinct - set(previous))


# msa_slot is the layer's index: left unspecialized, the layers share one compiled kernel (Triton would make
# slot 1 a constant, for which `.to` does not exist, and compile slot 0 and 16, 32, ... apart).
@triton.jit(do_not_specialize=["msa_slot"])
def _resolve_kernel(
    page_ids_ptr, row_indptr_ptr, query_start_ptr, handles_ptr,
    slot_block_ptr, slot_stamp_ptr, slot_page_ptr, previous_ptr, clock_ptr,
    miss_src_ptr, miss_dst_ptr, miss_count_ptr, stats_ptr,
    msa_slot, num_msa_layers, num_device, queue_stride,
    HKV: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
    NUM_STATS: tl.constexpr,
):  # fmt: skip
    request = tl.program_id(0)
    handle = tl.load(handles_ptr + request)
    if handle >= 0:
        # Entries e = (KV head e // TOPK, rank e % TOPK) of the request's one decode token.
        token = tl.load(query_start_ptr + request)
        e = tl.arange(0, E)
        head = e // TOPK
        rank = e % TOPK
        in_rows = head < HKV
        row = token * HKV + head
        start = tl.load(row_indptr_ptr + row, mask=in_rows, other=0)
        end = tl.load(row_indptr_ptr + row + 1, mask=in_rows, other=0)
        valid = in_rows & (rank < end - start)
        virtual = tl.load(page_ids_ptr + start + rank, mask=valid, other=0)
        page = tl.where(valid, virtual // HKV, -1)
        is_host = valid & (page >= num_device)
        earlier = e[None, :] < e[:, None]  # [e, e']: e' comes before e
        same = page[:, None] == page[None, :]
        first = valid & (tl.max((same & earlier & valid[None, :]).to(tl.int32), axis=1) == 0)

        base = (handle * num_msa_layers + msa_slot).to(tl.int64) * H
        s = tl.arange(0, HP)
        s_ok = s < H
        block = tl.load(slot_block_ptr + base + s, mask=s_ok, other=-2)
        stamp = tl.load(slot_stamp_ptr + base + s, mask=s_ok, other=0x7FFFFFFF)
        match = (page[:, None] == block[None, :]) & is_host[:, None]  # [E, HP]
        hit = tl.max(match.to(tl.int32), axis=1) > 0
        used = tl.max(match.to(tl.int32), axis=0) > 0
        new_miss = first & is_host & ~hit
        ordinal = tl.sum((new_miss[None, :] & earlier).to(tl.int32), axis=1)  # misses before each entry
        free = s_ok & ~used
        before = (stamp[None, :] < stamp[:, None]) | ((stamp[None, :] == stamp[:, None]) & (s[None, :] < s[:, None]))
        lru_rank = tl.sum((before & free[None, :]).to(tl.int32), axis=1)  # free slots older than each slot
        takes = new_miss[:, None] & free[None, :] & (lru_rank[None, :] == ordinal[:, None])  # [E, HP]
        incoming = tl.max(tl.where(takes, page[:, None], -1), axis=0)  # block a slot receives, or -1
        filled = incoming >= 0
        block = tl.where(filled, incoming, block)
        slot = tl.max(tl.where((page[:, None] == block[None, :]) & is_host[:, None], s[None, :], -1), axis=1)
        hot_page = tl.load(slot_page_ptr + handle.to(tl.int64) * H + slot, mask=is_host, other=0)
        tl.store(page_ids_ptr + start + rank, hot_page * HKV + head, mask=is_host)
        clock = tl.load(clock_ptr)
        tl.store(slot_block_ptr + base + s, block, mask=s_ok)
        tl.store(slot_stamp_ptr + base + s, tl.where(used | filled, clock, stamp), mask=s_ok)

        num_filled = tl.sum(filled.to(tl.int32), axis=0)
        at = tl.atomic_add(miss_count_ptr + msa_slot, num_filled) + tl.cumsum(filled.to(tl.int32), axis=0) - 1
        queue = msa_slot.to(tl.int64) * queue_stride
        slot_pages = tl.load(slot_page_ptr + handle.to(tl.int64) * H + s, mask=s_ok, other=0)
        tl.store(miss_src_ptr + queue + at, incoming - num_device, mask=filled)
        tl.store(miss_dst_ptr + queue + at, slot_pages, mask=filled)

        prev_base = (handle * num_msa_layers + msa_slot).to(tl.int64) * E
        previous = tl.load(previous_ptr + prev_base + e)
        had_previous = tl.max(previous, axis=0) >= 0
        known = tl.max((page[:, None] == previous[None, :]).to(tl.int32), axis=1) > 0
        tl.store(previous_ptr + prev_base + e, tl.where(first, page, -1))
        stat = stats_ptr + msa_slot * NUM_STATS
        tl.atomic_add(stat + 0, tl.sum((first & is_host & hit).to(tl.int64), axis=0))
        tl.atomic_add(stat + 1, num_filled.to(tl.int64))
        if had_previous:
            tl.atomic_add(stat + 2, tl.sum(first.to(tl.int64), axis=0))
            tl.atomic_add(stat + 3, tl.sum((first & ~known).to(tl.int64), axis=0))


def entries_per_request(num_kv_heads: int, topk: int) -> int:
    """Width of one request's entry vector (and of its stored previous selection): a power of two."""
    return triton.next_power_of_2(num_kv_heads * topk)


def resolve_decode_pages(
    page_ids: torch.Tensor,
    row_indptr: torch.Tensor,
    query_start_loc: torch.Tensor,
    handles: torch.Tensor,
    state: HotStateTensors,
    msa_slot: int,
    num_device: int,
    num_kv_heads: int,
    topk: int,
) -> None:
    """Rewrite the host blocks of ``page_ids`` (virtual ids ``page * Hkv + head``, rows ``token * Hkv + head``)
    to hot-buffer pages and append the misses to the layer's copy queue (``state.miss_*``).

    Requests with ``handles[r] < 0`` have no host block and are left alone; the others must add exactly
    one token this step.  Grid: one program per request, so launches are fixed per batch size.
    """
    num_requests = handles.numel()
    if num_requests == 0:
        return
    hot_blocks = state.slot_page.shape[1]
    _resolve_kernel[(num_requests,)](
        page_ids, row_indptr, query_start_loc, handles,
        state.slot_block, state.slot_stamp, state.slot_page, state.previous, state.clock,
        state.miss_src, state.miss_dst, state.miss_count, state.stats,
        msa_slot, state.slot_block.shape[1], num_device, state.miss_src.shape[1],
        HKV=num_kv_heads, TOPK=topk, E=entries_per_request(num_kv_heads, topk), H=hot_blocks,
        HP=triton.next_power_of_2(hot_blocks), NUM_STATS=NUM_STATS, num_warps=4,
    )  # fmt: skip
