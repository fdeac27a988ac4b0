"""The Triton decode indexer (scan + merge) against the fp32 reference, on CPU under the interpreter.

(The interpreter's ``tl.dot`` mishandles bfloat16, so CPU runs use float32 and float16; bfloat16
runs in the GPU suite, tests/gpu/test_msa_decode.py.)
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest
import torch

from m3stack.engine.kv_cache.tensors import LayerKVCache
from m3stack.engine.msa import reference, store
from m3stack.engine.msa.decode_index import (
    NewKeys,
    ScanConfig,
    _merge_shape,
    decode_index_topk,
    scan_index_pages,
)
from m3stack.engine.msa.decode_plan import SparseDecodeShape, plan_sparse_decode
from tests.engine.msa.prefill_support import PagedBatch, assert_selection_matches, paged_batch, with_fp8_index

BLOCK, HKV, INDEX_DIM = 16, 2, 16
# Ragged decode batch: long and short contexts, exact block multiples and tails, a request still
# inside its first block, and requests with several new tokens (MTP) that straddle a block edge.
REQUESTS = [(250, 1), (37, 1), (16, 1), (130, 3), (96, 2), (9, 1), (177, 4)]


def make_batch(
    dtype: torch.dtype, seed: int, requests: list[tuple[int, int]] = REQUESTS, heads: int = HKV
) -> tuple[PagedBatch, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch = paged_batch(requests, num_kv_heads=heads, head_dim=16, index_dim=INDEX_DIM, block_size=BLOCK,
                        dtype=dtype, device="cpu", generator=generator)  # fmt: skip
    index_q = torch.randn(batch.metadata.num_tokens, heads, INDEX_DIM, generator=generator).to(dtype)
    return batch, index_q


def shape_for(topk: int, local_blocks: int, heads: int = HKV) -> SparseDecodeShape:
    return SparseDecodeShape(num_q_heads=2 * heads, num_kv_heads=heads, head_dim=16, index_head_dim=INDEX_DIM,
                             block_size=BLOCK, topk=topk, local_blocks=local_blocks)  # fmt: skip


def check_against_reference(batch: PagedBatch, index_q: torch.Tensor, shape: SparseDecodeShape, splits: int | None,
                            config: ScanConfig | None = None, tolerance: float | None = None) -> None:  # fmt: skip
    metadata = batch.metadata
    plan = plan_sparse_decode(metadata, shape, torch.device("cpu"), scan_splits=splits)
    plan.page_ids.fill_(-7)  # poison: every entry must be written
    selected = decode_index_topk(index_q, batch.index_key_cache, metadata, plan, config,
                                 index_key_scale=batch.index_key_scale)  # fmt: skip
    heads = shape.num_kv_heads
    assert selected.dtype == torch.int32 and selected.shape == (heads, metadata.num_tokens, shape.topk)
    if tolerance is None:
        tolerance = 0.0 if index_q.dtype == torch.float32 else 1e-5
    for request, (start, stop) in enumerate(batch.token_ranges):
        positions = batch.request_positions(request)
        keys = batch.index_keys[request]
        expected = reference.index_block_topk(index_q[start:stop], keys, positions, BLOCK, shape.topk,
                                              shape.local_blocks)  # fmt: skip
        scores = reference.block_scores(index_q[start:stop], keys, positions, BLOCK)
        assert_selection_matches(selected[:, start:stop], expected, scores, shape.local_blocks, tolerance)
    # The attention's page lists: row (t, h) holds the selected blocks' virtual pages in the same order.
    assert not (plan.page_ids == -7).any()
    for token in range(metadata.num_tokens):
        request = int(plan.token_request[token])
        for head in range(heads):
            row = token * heads + head
            pages = plan.page_ids[plan.row_indptr[row] : plan.row_indptr[row + 1]]
            blocks = selected[head, token][selected[head, token] >= 0].long()
            assert torch.equal(pages, metadata.page_table[request, blocks] * heads + head)
            assert int(plan.last_page_len[row]) == int(metadata.positions[token]) % BLOCK + 1


@pytest.mark.parametrize(("dtype", "splits"), [(torch.float32, 1), (torch.float32, None), (torch.float16, 3)],
                         ids=["fp32-one-split", "fp32-default-splits", "fp16-three-splits"])  # fmt: skip
def test_selection_and_page_ids_match_reference(dtype: torch.dtype, splits: int | None) -> None:
    batch, index_q = make_batch(dtype, seed=11 + (splits or 0))
    check_against_reference(batch, index_q, shape_for(topk=4, local_blocks=1), splits)


@pytest.mark.parametrize("heads", [1, 2])
def test_single_token_requests_of_a_tensor_parallel_rank(heads: int) -> None:
    """A TP rank's 1 or 2 index heads give a decode request fewer columns than the merge's minimum: the padding
    columns must neither change the selection nor write anything (the page ids are poisoned beforehand)."""
    batch, index_q = make_batch(torch.float32, seed=17, requests=[(250, 1), (37, 1), (16, 1), (9, 1)], heads=heads)
    check_against_reference(batch, index_q, shape_for(topk=4, local_blocks=1, heads=heads), splits=2)


@pytest.mark.parametrize("page_ids_ahead", [False, True], ids=["page-ids-in-step", "page-ids-ahead"])
def test_two_local_blocks_wide_topk_and_two_pages_per_step(page_ids_ahead: bool) -> None:
    batch, index_q = make_batch(torch.float32, seed=5)
    config = ScanConfig(pages_per_iteration=2, page_ids_ahead=page_ids_ahead)
    check_against_reference(batch, index_q, shape_for(topk=8, local_blocks=2), splits=2, config=config)


def test_split_major_launch_order_selects_the_same_blocks_over_shared_prefix_pages() -> None:
    """Requests whose page tables share their prefix pages (one agentic prefix), scanned split-major."""
    batch, index_q = make_batch(torch.float32, seed=37, requests=[(250, 1), (250, 1), (250, 1), (130, 3)])
    shared = batch.metadata.page_table
    shared[1:3, :15] = shared[0, :15]  # requests 1 and 2 read request 0's first 15 blocks (their own last one)
    batch.index_keys[1][: 15 * BLOCK] = batch.index_keys[0][: 15 * BLOCK]
    batch.index_keys[2][: 15 * BLOCK] = batch.index_keys[0][: 15 * BLOCK]
    config = ScanConfig(split_major=True)
    check_against_reference(batch, index_q, shape_for(topk=4, local_blocks=1), splits=3, config=config)


def test_page_ids_loaded_ahead_select_the_same_blocks() -> None:
    batch, index_q = make_batch(torch.float16, seed=13)
    config = ScanConfig(page_ids_ahead=True)
    check_against_reference(batch, index_q, shape_for(topk=4, local_blocks=1), splits=3, config=config)


@pytest.mark.parametrize("merge_warps", [1, 2])
def test_a_separate_merge_in_few_warps_splits_its_columns_over_programs(merge_warps: int) -> None:
    """At 128 splits a merge program of one (two) warps ranks 4 (8) of the 8 stored columns (4 tokens x 2 heads):
    the columns of a request are merged by several programs.  Top-16 (lists of 16 slots, M3's): fewer slots are
    always merged by 4 warps."""
    batch, index_q = make_batch(torch.float32, seed=23, requests=[(600, 1), (130, 3), (377, 4)])
    shape = shape_for(topk=16, local_blocks=1)
    config = ScanConfig(fused_merge=False, merge_warps=merge_warps)
    plan = plan_sparse_decode(batch.metadata, shape, torch.device("cpu"), scan_splits=128)
    scan = scan_index_pages(index_q, batch.index_key_cache, batch.metadata, plan, config)
    assert scan.merge_warps == merge_warps and scan.merge.columns_per_program == 4 * merge_warps
    check_against_reference(batch, index_q, shape, splits=128, config=config)


def test_lists_of_few_slots_are_merged_by_four_warps_whatever_the_config() -> None:
    """One warp over 4-slot lists (the tiny model's top-4) selected other blocks than four warps on the H200, two
    faulted: those lists always get four."""
    batch, index_q = make_batch(torch.float32, seed=31, requests=[(250, 1), (130, 3)])
    for topk, warps in ((4, 4), (9, 4), (17, 1)):
        plan = plan_sparse_decode(batch.metadata, shape_for(topk, 1), torch.device("cpu"), scan_splits=8)
        config = ScanConfig(fused_merge=False, merge_warps=1)
        assert scan_index_pages(index_q, batch.index_key_cache, batch.metadata, plan, config).merge_warps == warps


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_no_merge_program_ranks_two_columns(heads: int) -> None:
    """A 2-column merge program faults on the H200 (``_MIN_MERGE_COLUMNS``): whatever the columns, splits and
    warps, a merge program takes 1 or >= 4 columns, and the programs cover the columns evenly."""
    batch, _ = make_batch(torch.float32, seed=29, requests=[(250, 1), (130, 3)], heads=heads)
    for splits in (1, 3, 100, 129, 256, 300, 512):
        plan = plan_sparse_decode(batch.metadata, shape_for(4, 1, heads), torch.device("cpu"), scan_splits=splits)
        for warps in (1, 2, 4, 8):
            merge = _merge_shape(plan, warps)
            assert merge.columns_stored >= 4 and merge.columns_stored % merge.columns_per_program == 0
            assert merge.columns_per_program != 2, (splits, warps, merge)


def test_scan_configs_refuse_a_merge_warp_count_triton_cannot_launch() -> None:
    with pytest.raises(ValueError, match="merge_warps"):
        ScanConfig(fused_merge=False, merge_warps=3)


@pytest.mark.parametrize("value", [1.0, 0.0], ids=["equal-keys", "zero-keys"])
def test_ties_go_to_the_lower_block_across_splits(value: float) -> None:
    """Equal index keys make every block score equal (zero keys: +0.0 and -0.0 alike, as in MiniMax's
    all-zero test): the lowest ids must win even when the winners come from different splits."""
    batch, index_q = make_batch(torch.float32, seed=3, requests=[(300, 1), (200, 2)])
    batch.index_key_cache.fill_(value)
    for keys in batch.index_keys:
        keys.fill_(value)
    check_against_reference(batch, index_q, shape_for(topk=6, local_blocks=1), splits=4)


def test_too_many_tokens_per_request_are_refused() -> None:
    batch, index_q = make_batch(torch.float32, seed=2, requests=[(200, 40)])
    plan = plan_sparse_decode(batch.metadata, shape_for(4, 1), torch.device("cpu"))
    with pytest.raises(ValueError, match="prefill indexer"):
        decode_index_topk(index_q, batch.index_key_cache, batch.metadata, plan)
    with pytest.raises(ValueError, match="index_q has shape"):
        decode_index_topk(index_q[:, :1], batch.index_key_cache, batch.metadata, plan)


def test_fp8_index_keys_match_the_reference_on_the_same_keys() -> None:
    """An fp8 (e4m3) k-index halves the scan's bytes; the queries stay in their type, so the kernel
    must select exactly what the reference selects from the dequantized keys."""
    batch, index_q = make_batch(torch.float32, seed=13)
    fp8_cache = batch.index_key_cache.to(torch.float8_e4m3fn)
    batch.index_key_cache = fp8_cache
    batch.index_keys = [keys.to(torch.float8_e4m3fn).float() for keys in batch.index_keys]
    check_against_reference(batch, index_q, shape_for(topk=4, local_blocks=1), splits=2)


# Scores of scaled fp8 keys: the kernel scales the key's dot product, the reference dots the scaled key (products of
# a 4-bit and a 24-bit mantissa round differently in fp32), so near-ties may flip.
FP8_SCORE_TOLERANCE = 1e-4


@pytest.mark.parametrize(
    ("config", "splits"),
    [(ScanConfig(), 3), (ScanConfig(fused_merge=False, merge_warps=1), None), (ScanConfig(shared_pages=True), 2),
     (ScanConfig(pages_per_iteration=2, page_ids_ahead=True), 2)],
    ids=["fused-merge", "merge-launch", "shared-pages", "two-pages-ahead"],
)  # fmt: skip
def test_scaled_fp8_index_keys_select_what_the_reference_selects_from_the_dequantized_keys(
    config: ScanConfig, splits: int | None
) -> None:
    """The engine's fp8 k-index: e4m3 keys with a float32 scale per token in the same pages."""
    batch, index_q = make_batch(torch.float32, seed=29)
    check_against_reference(with_fp8_index(batch), index_q, shape_for(topk=4, local_blocks=1), splits, config,
                            FP8_SCORE_TOLERANCE)  # fmt: skip


def test_an_fp8_k_index_scored_by_bf16_queries_selects_alike_at_any_query_magnitude() -> None:
    """bf16 queries over the fp8 k-index multiply in fp16, each query column shifted by a power of two from its
    largest magnitude: the selection matches the reference's from the same bf16 queries, and queries scaled by
    2 ** 40, 2 ** 20 or 2 ** -20 (past fp16's range either way) select exactly the same blocks."""
    batch, index_q = make_batch(torch.float32, seed=41)
    batch = with_fp8_index(batch)
    index_q = index_q.to(torch.bfloat16)
    check_against_reference(batch, index_q, shape_for(topk=4, local_blocks=1), 2, tolerance=FP8_SCORE_TOLERANCE)
    plan = plan_sparse_decode(batch.metadata, shape_for(topk=4, local_blocks=1), torch.device("cpu"), scan_splits=2)

    def selection(queries: torch.Tensor) -> torch.Tensor:
        return decode_index_topk(queries, batch.index_key_cache, batch.metadata, plan,
                                 index_key_scale=batch.index_key_scale).clone()  # fmt: skip

    unscaled = selection(index_q)
    for exponent in (40, 20, -20):
        assert torch.equal(selection(index_q * 2.0**exponent), unscaled), exponent


@pytest.mark.parametrize("shared_pages", [False, True], ids=["per-request-scan", "shared-page-scan"])
def test_the_scan_stores_new_index_keys_into_an_fp8_k_index_as_the_store_does(shared_pages: bool) -> None:
    """The scan's fused store quantizes each new index key with its own scale, byte for byte as ``store_kv``."""
    batch, index_q = make_batch(torch.float32, seed=37, requests=[(250, 1), (37, 1), (16, 1), (129, 1)])
    batch = with_fp8_index(batch)
    metadata = batch.metadata
    shape = shape_for(topk=4, local_blocks=1)
    plan = plan_sparse_decode(metadata, shape, torch.device("cpu"), scan_splits=2)
    generator = torch.Generator().manual_seed(8)
    k, v = (torch.randn(metadata.num_tokens, HKV, 16, generator=generator) for _ in range(2))
    index_k = torch.randn(metadata.num_tokens, INDEX_DIM, generator=generator) * torch.tensor([[0.01], [3], [50], [1]])
    twin = LayerKVCache(batch.key_cache.clone(), batch.value_cache.clone(), batch.index_key_cache.clone(),
                        batch.index_key_scale.clone())  # fmt: skip
    store.store_kv(twin, metadata.slot_mapping, k, v, index_k, torch_only=True)
    cache = LayerKVCache(batch.key_cache, batch.value_cache, batch.index_key_cache, batch.index_key_scale)
    decode_index_topk(index_q, cache.index_key, metadata, plan, ScanConfig(shared_pages=shared_pages),
                      NewKeys(cache, metadata.slot_mapping, k, v, index_k), cache.index_key_scale)  # fmt: skip
    slots = metadata.slot_mapping.long()
    pages, offsets = slots // BLOCK, slots % BLOCK
    assert torch.equal(cache.index_key_scale[pages, offsets], twin.index_key_scale[pages, offsets])
    assert torch.equal(
        cache.index_key[pages, offsets].view(torch.uint8), twin.index_key[pages, offsets].view(torch.uint8)
    )
    for got, want in ((cache.key, twin.key), (cache.value, twin.value)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # NaN: slots nothing wrote


def shared_prefix_batch(seed: int) -> tuple[PagedBatch, torch.Tensor]:
    """Seven requests: 0-2 and 4-6 share their first 10 and 13 blocks (two agentic prefixes; 4-6 also straddle the
    window of 4 requests a program serves), 3 shares nothing; contexts differ, so their last splits differ too."""
    requests = [(250, 1), (251, 1), (262, 1), (130, 1), (240, 1), (229, 1), (245, 1)]
    batch, index_q = make_batch(torch.float32, seed=seed, requests=requests)
    table = batch.metadata.page_table
    for leader, members, blocks in ((0, (1, 2), 10), (4, (5, 6), 13)):
        for member in members:
            table[member, :blocks] = table[leader, :blocks]
            batch.index_keys[member][: blocks * BLOCK] = batch.index_keys[leader][: blocks * BLOCK]
    return batch, index_q


@pytest.mark.parametrize(("splits", "group", "split_major"), [(3, 4, False), (5, 1, False), (2, 16, True)])
def test_shared_page_scans_select_what_each_request_scanned_alone_would(splits: int, group: int,
                                                                        split_major: bool) -> None:  # fmt: skip
    """Programs that scan a split's pages for a run of requests sharing them (with splits of equal blocks in
    every request) select the reference's blocks for every member, and the same as the per-request scan."""
    batch, index_q = shared_prefix_batch(seed=41)
    shape = shape_for(topk=4, local_blocks=1)
    config = ScanConfig(shared_pages=True, shared_group=group, split_major=split_major)
    check_against_reference(batch, index_q, shape, splits=splits, config=config)
    metadata = batch.metadata
    selections = []
    for scan_config in (ScanConfig(fused_merge=False), config):
        plan = plan_sparse_decode(metadata, shape, torch.device("cpu"), scan_splits=splits)
        selections.append((decode_index_topk(index_q, batch.index_key_cache, metadata, plan, scan_config),
                           plan.page_ids.clone()))  # fmt: skip
    assert torch.equal(selections[0][0], selections[1][0]) and torch.equal(selections[0][1], selections[1][1])


def test_shared_page_scans_store_every_requests_new_keys() -> None:
    """The scan's side task (storing the step's keys) runs in every request's split-0 program, leader or not."""
    batch, index_q = shared_prefix_batch(seed=43)
    metadata = batch.metadata
    shape = shape_for(topk=4, local_blocks=1)
    plan = plan_sparse_decode(metadata, shape, torch.device("cpu"), scan_splits=2)
    cache = LayerKVCache(batch.key_cache, batch.value_cache, batch.index_key_cache)
    slots = metadata.slot_mapping
    pages, offsets = slots.long() // BLOCK, slots.long() % BLOCK
    cache.key[pages, :, offsets] = float("nan")
    generator = torch.Generator().manual_seed(3)
    k, v = (torch.randn(metadata.num_tokens, HKV, 16, generator=generator) for _ in range(2))
    index_k = cache.index_key[pages, offsets].clone()  # the keys already there: the selection stays the reference's
    new_keys = NewKeys(cache, slots, k, v, index_k)
    decode_index_topk(index_q, cache.index_key, metadata, plan, ScanConfig(shared_pages=True), new_keys)
    assert torch.equal(cache.key[pages, :, offsets], k) and torch.equal(cache.value[pages, :, offsets], v)


def test_shared_group_sizes_the_kernel_cannot_run_are_refused() -> None:
    for group in (0, 3, 32):
        with pytest.raises(ValueError, match="shared_group"):
            ScanConfig(shared_pages=True, shared_group=group)


def test_shared_page_scans_of_requests_with_several_new_tokens() -> None:
    """MTP-like requests (2-3 new tokens: 8 stored columns each) sharing prefix pages: 4 requests' columns a program."""
    batch, index_q = make_batch(torch.float32, seed=47, requests=[(250, 3), (251, 3), (262, 2), (245, 1), (130, 2)])
    table = batch.metadata.page_table
    for member in (1, 2, 3):
        table[member, :12] = table[0, :12]
        batch.index_keys[member][: 12 * BLOCK] = batch.index_keys[0][: 12 * BLOCK]
    config = ScanConfig(shared_pages=True, shared_group=16)
    check_against_reference(batch, index_q, shape_for(topk=4, local_blocks=1), splits=4, config=config)
