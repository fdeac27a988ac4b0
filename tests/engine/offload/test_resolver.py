"""Hot-buffer resolution: the rules on hand-worked steps, and the Triton kernel (CPU interpreter) held to them."""

import random

import pytest
import torch

from m3stack.engine.offload.hot_buffer import STAT_CHURNED, STAT_HITS, STAT_MISSES, STAT_SELECTED, HotStateTensors
from m3stack.engine.offload.resolver import churn, entries_per_request, resolve_decode_pages, resolve_request

NUM_DEVICE = 10


def test_hits_keep_their_slot_misses_take_the_least_recently_used_one():
    blocks, stamps = [-1, -1, -1], [0, 0, 0]
    first = resolve_request([12, 3, 12, 15, -1], blocks, stamps, clock=1, num_device=NUM_DEVICE)
    assert first.slots == [0, -1, 0, 1, -1] and first.copies == [(0, 12), (1, 15)] and first.hits == 0
    assert blocks == [12, 15, -1] and stamps == [1, 1, 0]
    # 15 hits slot 1; the misses take slot 2 (never used) and then slot 0 (older than 1's new stamp).
    second = resolve_request([15, 20, 21], blocks, stamps, clock=2, num_device=NUM_DEVICE)
    assert second.slots == [1, 2, 0] and second.copies == [(2, 20), (0, 21)] and second.hits == 1
    assert blocks == [21, 15, 20] and stamps == [2, 2, 2]
    third = resolve_request([12], blocks, stamps, clock=3, num_device=NUM_DEVICE)  # equal stamps: the lowest slot
    assert third.slots == [0] and third.copies == [(0, 12)] and blocks == [12, 15, 20]


def test_more_host_blocks_than_slots_is_an_error():
    with pytest.raises(RuntimeError, match="exceed the hot buffer"):
        resolve_request([10, 11, 12, 13], [-1, -1, -1], [0, 0, 0], clock=1, num_device=NUM_DEVICE)


def test_churn_counts_blocks_new_since_the_previous_step():
    assert churn([1, 2, 2, 3], [-1, -1]) == (0, 0)
    assert churn([1, 2, 2, 3, -1], [2, 7, -1]) == (3, 2)


HKV, TOPK, HOT = 2, 4, 8


def _state(handles: int, layers: int, max_batch: int, device: torch.device) -> HotStateTensors:
    state = HotStateTensors.allocate(max_requests=handles, num_msa_layers=layers, hot_blocks=HOT,
                                     entries=entries_per_request(HKV, TOPK), max_batch=max_batch,
                                     device=device)  # fmt: skip
    for handle in range(handles):
        state.slot_page[handle] = torch.arange(HOT, dtype=torch.int32) + 1 + HOT * handle
    return state


def test_kernel_follows_the_rules_over_steps():
    check_kernel_follows_the_rules(torch.device("cpu"))


def check_kernel_follows_the_rules(device: torch.device) -> None:
    """Three requests (the middle one has no host block), two MSA layers, five steps of random selections.
    Also run compiled on the GPU (tests/gpu/test_offload.py): layer slot 1 is what Triton specializes."""
    rng = random.Random(11)
    handles = torch.tensor([1, -1, 0], dtype=torch.int32, device=device)
    state = _state(handles=2, layers=2, max_batch=3, device=device)
    python_state = {(h, layer): ([-1] * HOT, [0] * HOT, [-1]) for h in (0, 1) for layer in (0, 1)}
    expected_stats = torch.zeros_like(state.stats).cpu()
    query_start = torch.arange(4, dtype=torch.int32, device=device)
    for clock in range(1, 6):
        state.begin_step()
        for layer in (0, 1):
            lengths = [rng.randint(1, TOPK) for _ in range(3 * HKV)]
            row_indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                                      device=device)  # fmt: skip
            pages = []
            for row, length in enumerate(lengths):
                is_host = handles[row // HKV] >= 0
                pool = range(NUM_DEVICE, NUM_DEVICE + 12) if is_host else range(1, NUM_DEVICE)
                chosen = [*rng.sample(list(pool), length - 1), rng.randrange(1, NUM_DEVICE)]  # local block last
                pages.append(chosen)
            virtual = torch.tensor([p * HKV + row % HKV for row, chosen in enumerate(pages) for p in chosen],
                                   dtype=torch.int32, device=device)  # fmt: skip
            page_ids = virtual.clone()
            resolve_decode_pages(page_ids, row_indptr, query_start, handles, state, layer, NUM_DEVICE, HKV, TOPK)
            expected = virtual.clone()
            expected_copies = set()
            for request in range(3):
                handle = int(handles[request])
                rows = range(request * HKV, (request + 1) * HKV)
                entries = [(row, j, pages[row][j]) for row in rows for j in range(TOPK) if j < lengths[row]]
                if handle < 0:
                    continue
                blocks, stamps, previous = python_state[(handle, layer)]
                ordered = [page for _, _, page in entries]
                resolution = resolve_request(ordered, blocks, stamps, clock, NUM_DEVICE)
                hot_pages = state.slot_page[handle].tolist()
                for (row, j, _), slot in zip(entries, resolution.slots, strict=True):
                    if slot >= 0:
                        expected[int(row_indptr[row]) + j] = hot_pages[slot] * HKV + row % HKV
                expected_copies |= {(page - NUM_DEVICE, hot_pages[slot]) for slot, page in resolution.copies}
                selected, churned = churn(ordered, previous)
                previous[:] = list(dict.fromkeys(p for p in ordered if p >= 0))
                expected_stats[layer] += torch.tensor([resolution.hits, len(resolution.copies), selected, churned])
                assert state.slot_block[handle, layer].tolist() == blocks
                assert state.slot_stamp[handle, layer].tolist() == stamps
            assert torch.equal(page_ids, expected), (clock, layer)
            count = int(state.miss_count[layer])
            queued = set(zip(state.miss_src[layer, :count].tolist(), state.miss_dst[layer, :count].tolist(),
                             strict=True))  # fmt: skip
            assert queued == expected_copies
    assert torch.equal(state.stats.cpu(), expected_stats)
    assert int(state.stats[:, STAT_HITS].sum()) > 0 and int(state.stats[:, STAT_MISSES].sum()) > 0
    assert int(state.stats[:, STAT_CHURNED].sum()) < int(state.stats[:, STAT_SELECTED].sum())
