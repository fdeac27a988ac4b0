"""MSA decode on the GPU at M3 attention dims (bf16) against the fp32 reference: the Triton indexer
(several scan configurations), FlashInfer's flattened sparse decode and the Triton fallback, a CUDA
graph replayed on new inputs, and the GPU backend against the reference backend over engine steps.

The batch is ragged: contexts of 1 token, around block edges, mid-size and 300K, plus requests
with several new tokens (MTP); unused cache slots are NaN and outputs start as NaN, so any read of
an unwritten slot or any unwritten output shows.
"""

import dataclasses

import pytest
import torch

from m3stack.engine.attention.gpu import GpuAttentionBackend
from m3stack.engine.attention.reference import ReferenceAttentionBackend
from m3stack.engine.kv_cache.tensors import KVCacheSpec, LayerKVCache, allocate_kv_cache, quantize_index_keys
from m3stack.engine.msa import reference
from m3stack.engine.msa.decode_attention import FlashInferSparseDecode, TritonDecodeConfig, sparse_decode_attention
from m3stack.engine.msa.decode_fused import select_and_attend
from m3stack.engine.msa.decode_index import (
    MAX_DECODE_COLUMNS,
    NewKeys,
    ScanConfig,
    decode_index_topk,
    scan_index_pages,
)
from m3stack.engine.msa.decode_plan import SparseDecodePlan, SparseDecodeShape, plan_sparse_decode
from m3stack.engine.msa.decode_tuning import DecodeTuning
from tests.engine.attention.step_support import step_metadata
from tests.engine.msa.prefill_support import PagedBatch, assert_selection_matches, paged_batch, with_fp8_index

SHAPE = SparseDecodeShape(num_q_heads=64, num_kv_heads=4, head_dim=128, index_head_dim=128, block_size=128, topk=16,
                          local_blocks=1)  # fmt: skip
SCALE = SHAPE.head_dim**-0.5
# bf16 products are exact in fp32; the kernel sums 128 of them in another order than the reference.
SCORE_TOLERANCE = 2e-3
OUT_TOLERANCE = 2e-2  # bf16 inputs and output against an fp32 reference
PREFILL_TOLERANCE = 3e-2  # the MSA prefill kernels keep bf16 partials (tests/gpu/test_msa_prefill.py)
REQUESTS = [(1, 1), (127, 1), (128, 1), (129, 1), (2049, 4), (5000, 1), (40000, 3), (70001, 1), (300000, 1)]


@pytest.fixture(scope="module")
def batch() -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2026)
    paged = paged_batch(REQUESTS, num_kv_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim,
                        index_dim=SHAPE.index_head_dim, block_size=SHAPE.block_size, dtype=torch.bfloat16,
                        device="cuda", generator=generator)  # fmt: skip
    tokens = paged.metadata.num_tokens
    q = torch.randn(tokens, SHAPE.num_q_heads, SHAPE.head_dim, generator=generator).to("cuda", torch.bfloat16)
    index_q = torch.randn(tokens, SHAPE.num_kv_heads, SHAPE.index_head_dim, generator=generator)
    return paged, q, index_q.to("cuda", torch.bfloat16)


def check_selection(paged: PagedBatch, index_q: torch.Tensor, selected: torch.Tensor) -> None:
    for request, (start, stop) in enumerate(paged.token_ranges):
        positions = paged.request_positions(request)
        keys = paged.index_keys[request]
        expected = reference.index_block_topk(index_q[start:stop], keys, positions, SHAPE.block_size, SHAPE.topk,
                                              SHAPE.local_blocks)  # fmt: skip
        scores = reference.block_scores(index_q[start:stop], keys, positions, SHAPE.block_size)
        assert_selection_matches(selected[:, start:stop], expected, scores, SHAPE.local_blocks, SCORE_TOLERANCE)


def check_attention(paged: PagedBatch, q: torch.Tensor, selected: torch.Tensor, out: torch.Tensor) -> None:
    assert not out.isnan().any()
    for request, (start, stop) in enumerate(paged.token_ranges):
        expected = reference.sparse_attention(
            q[start:stop], paged.keys[request], paged.values[request], paged.request_positions(request),
            selected[:, start:stop], SHAPE.block_size, SCALE,
        )  # fmt: skip
        torch.testing.assert_close(out[start:stop].float(), expected, atol=OUT_TOLERANCE, rtol=OUT_TOLERANCE)


@pytest.mark.parametrize(
    ("config", "splits"),
    [
        (ScanConfig(), None),
        (ScanConfig(2, 8, 3), 7),
        (ScanConfig(1, 8, 4), 512),
        (ScanConfig(page_ids_ahead=True), None),
        (ScanConfig(1, 4, 4, page_ids_ahead=True), 5),
        (ScanConfig(fused_merge=False, merge_warps=1), 512),
        (ScanConfig(fused_merge=False, merge_warps=1), None),
        (ScanConfig(split_major=True), None),
        (ScanConfig(shared_pages=True), None),
        (ScanConfig(shared_pages=True, shared_group=16, page_ids_ahead=True), 7),
    ],
    ids=[
        "default",
        "two-pages-7-splits",
        "8-warps-512-splits",
        "page-ids-ahead",
        "page-ids-ahead-4-stages",
        "one-warp-merge-512-splits",
        "one-warp-merge",
        "split-major",
        "shared-pages",
        "shared-pages-16-ahead-7-splits",
    ],
)
def test_index_selection_and_page_ids(batch, config: ScanConfig, splits: int | None) -> None:
    paged, _, index_q = batch
    metadata = paged.metadata
    plan = plan_sparse_decode(metadata, SHAPE, torch.device("cuda"), scan_splits=splits)
    plan.page_ids.fill_(-7)
    selected = decode_index_topk(index_q, paged.index_key_cache, metadata, plan, config)
    check_selection(paged, index_q, selected)
    assert not (plan.page_ids == -7).any()
    token_request = plan.token_request.long()
    for token in range(metadata.num_tokens):
        for head in range(SHAPE.num_kv_heads):
            row = token * SHAPE.num_kv_heads + head
            pages = plan.page_ids[plan.row_indptr[row] : plan.row_indptr[row + 1]]
            blocks = selected[head, token][selected[head, token] >= 0].long()
            want = metadata.page_table[token_request[token], blocks] * SHAPE.num_kv_heads + head
            assert torch.equal(pages, want)


@pytest.mark.parametrize("group", [4, 16])
def test_shared_page_scans_over_one_agentic_prefix(group: int) -> None:
    """Twenty requests of which 0-8 and 10-19 share a prefix of 120 / 30 blocks (runs crossing the kernel's windows):
    every member selects the reference's blocks (within the score tolerance; the CPU tests check the selection
    equals the per-request scan's)."""
    generator = torch.Generator().manual_seed(9)
    requests = [(20100 + 37 * r, 1) for r in range(20)]
    paged = paged_batch(requests, num_kv_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim,
                        index_dim=SHAPE.index_head_dim, block_size=SHAPE.block_size, dtype=torch.bfloat16,
                        device="cuda", generator=generator)  # fmt: skip
    table = paged.metadata.page_table
    for leader, members, blocks in ((0, range(1, 9), 120), (10, range(11, 20), 30)):
        for member in members:
            table[member, :blocks] = table[leader, :blocks]
            paged.index_keys[member][: blocks * SHAPE.block_size] = paged.index_keys[leader][
                : blocks * SHAPE.block_size
            ]
    index_q = torch.randn(paged.metadata.num_tokens, SHAPE.num_kv_heads, SHAPE.index_head_dim, generator=generator)
    index_q = index_q.to("cuda", torch.bfloat16)
    plan = plan_sparse_decode(paged.metadata, SHAPE, torch.device("cuda"))
    config = ScanConfig(shared_pages=True, shared_group=group)
    check_selection(paged, index_q, decode_index_topk(index_q, paged.index_key_cache, paged.metadata, plan, config))


@pytest.mark.parametrize("index_heads", [1, 2])
def test_index_selection_with_a_tensor_parallel_ranks_few_heads(index_heads: int) -> None:
    """A rank of a TP=2 (TP=4) engine at M3 dims holds 2 (1) KV heads, so a decode request has 2 (1) index columns:
    the merge faulted with an illegal address there (the 2x H200 run of 2026-12-01) until its columns were
    padded.  Single-token requests only (the engine's pure decode steps), with the scan storing the new keys."""
    shape = dataclasses.replace(SHAPE, num_q_heads=16 * index_heads, num_kv_heads=index_heads)
    generator = torch.Generator().manual_seed(5)
    requests = [(1, 1), (129, 1), (449, 1), (5000, 1), (70001, 1)]
    paged = paged_batch(requests, num_kv_heads=index_heads, head_dim=shape.head_dim,
                        index_dim=shape.index_head_dim, block_size=shape.block_size, dtype=torch.bfloat16,
                        device="cuda", generator=generator)  # fmt: skip
    metadata = paged.metadata
    index_q = torch.randn(metadata.num_tokens, index_heads, shape.index_head_dim, generator=generator)
    index_q = index_q.to("cuda", torch.bfloat16)
    tokens = metadata.num_tokens
    kv_dims = (index_heads, shape.head_dim)
    new = [torch.randn(tokens, *dims, generator=generator).to("cuda", torch.bfloat16)
           for dims in (kv_dims, kv_dims, (shape.index_head_dim,))]  # fmt: skip
    cache = LayerKVCache(paged.key_cache, paged.value_cache, paged.index_key_cache)
    plan = plan_sparse_decode(metadata, shape, torch.device("cuda"))
    selected = decode_index_topk(index_q, paged.index_key_cache, metadata, plan,
                                 new_keys=NewKeys(cache, metadata.slot_mapping, *new))  # fmt: skip
    torch.cuda.synchronize()
    # The stored token sits in its request's last (local) block: the selection is the reference's over the keys as
    # they are now, which the batch's per-request copies give once the new index keys are put in them.
    for request, (start, stop) in enumerate(paged.token_ranges):
        positions = paged.request_positions(request)
        keys = paged.index_keys[request].clone()
        keys[positions] = new[2][start:stop]
        expected = reference.index_block_topk(index_q[start:stop], keys, positions, shape.block_size, shape.topk,
                                              shape.local_blocks)  # fmt: skip
        scores = reference.block_scores(index_q[start:stop], keys, positions, shape.block_size)
        assert_selection_matches(selected[:, start:stop], expected, scores, shape.local_blocks, SCORE_TOLERANCE)
    assert torch.equal(paged.index_key_cache.view(-1, shape.index_head_dim)[metadata.slot_mapping], new[2])


def planned_flashinfer(plan: SparseDecodePlan) -> FlashInferSparseDecode:
    """FlashInfer planned before the page ids exist, as in a decode step."""
    flashinfer = FlashInferSparseDecode(torch.device("cuda"))
    flashinfer.plan(plan, torch.bfloat16, SCALE)
    return flashinfer


@pytest.mark.parametrize("path", ["flashinfer", "triton"])
def test_sparse_decode_attention(batch, path: str) -> None:
    paged, q, index_q = batch
    metadata = paged.metadata
    plan = plan_sparse_decode(metadata, SHAPE, torch.device("cuda"))
    flashinfer = planned_flashinfer(plan) if path == "flashinfer" else None
    selected = decode_index_topk(index_q, paged.index_key_cache, metadata, plan)
    out = torch.full_like(q, float("nan"))
    sparse_decode_attention(q, paged.key_cache, paged.value_cache, plan, metadata.positions, metadata.page_table,
                            SCALE, flashinfer, out=out)  # fmt: skip
    check_attention(paged, q, selected, out)


@pytest.mark.parametrize("path", ["flashinfer", "triton"])
def test_cuda_graph_replays_the_decode_layer_on_new_inputs(batch, path: str) -> None:
    """Plan on the host, capture index + attention once, then replay with fresh q / index_q: the
    page ids are produced inside the graph, so the replay must follow the new selection."""
    paged, q, index_q = batch
    metadata = paged.metadata
    plan = plan_sparse_decode(metadata, SHAPE, torch.device("cuda"))
    flashinfer = planned_flashinfer(plan) if path == "flashinfer" else None
    q_in, index_q_in = q.clone(), index_q.clone()
    out = torch.full_like(q, float("nan"))

    def layer() -> torch.Tensor:
        selected = decode_index_topk(index_q_in, paged.index_key_cache, metadata, plan)
        sparse_decode_attention(q_in, paged.key_cache, paged.value_cache, plan, metadata.positions,
                                metadata.page_table, SCALE, flashinfer, out=out)  # fmt: skip
        return selected

    layer()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        selected = layer()
    generator = torch.Generator().manual_seed(9)
    q_in.copy_(torch.randn(q.shape, generator=generator))
    index_q_in.copy_(torch.randn(index_q.shape, generator=generator))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_selection(paged, index_q_in, selected)
    check_attention(paged, q_in, selected, out)


@pytest.mark.parametrize("pages_per_split", [None, 4])
def test_attention_that_merges_the_scan_lists_replays_in_a_graph(batch, pages_per_split: int | None) -> None:
    """``msa.decode_fused`` at M3 dims in bf16, launched with PDL after the scan inside a CUDA graph replayed on new
    inputs: the reference's selection (as sets, within the score tolerance) and its attention over it."""
    paged, q, index_q = batch
    metadata = paged.metadata
    plan = plan_sparse_decode(metadata, SHAPE, torch.device("cuda"))
    q_in, index_q_in = q.clone(), index_q.clone()
    out = torch.full_like(q, float("nan"))
    config = TritonDecodeConfig(pages_per_split=pages_per_split)

    def layer() -> torch.Tensor:
        scan = scan_index_pages(index_q_in, paged.index_key_cache, metadata, plan, ScanConfig(fused_merge=False))
        select_and_attend(q_in, paged.key_cache, paged.value_cache, scan, metadata, plan, SCALE, config, out=out)
        return scan.selected

    layer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        selected = layer()
    generator = torch.Generator().manual_seed(11)
    q_in.copy_(torch.randn(q.shape, generator=generator))
    index_q_in.copy_(torch.randn(index_q.shape, generator=generator))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_selection(paged, index_q_in, selected)
    check_attention(paged, q_in, selected, out)


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize(
    ("select_in_attention", "index_dtype", "kv_dtype"),
    [(False, None, None), (True, None, None), (False, FP8, None), (True, FP8, None), (True, FP8, FP8)],
    ids=["merge-launch", "select-in-attention", "merge-launch-fp8-index", "select-in-attention-fp8-index",
         "select-in-attention-fp8-caches"],
)  # fmt: skip
def test_backend_decode_layers_match_reference_backend(select_in_attention: bool, index_dtype: torch.dtype | None,
                                                       kv_dtype: torch.dtype | None) -> None:  # fmt: skip
    """Pure decode steps through ``GpuAttentionBackend.sparse`` (the scan storing the new keys, PDL launches) with
    either way of merging, over a bf16 or the engine's fp8 k-index and K/V, against the reference backend."""
    tuning = DecodeTuning(select_in_attention_min_requests=1 if select_in_attention else None)
    block = SHAPE.block_size
    spec = KVCacheSpec(
        num_layers=1, num_kv_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim, block_size=block,
        index_head_dim=SHAPE.index_head_dim, sparse_layers=(True,), dtype=torch.bfloat16, index_dtype=index_dtype,
        kv_dtype=kv_dtype,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(31)
    gpu_caches = allocate_kv_cache(spec, 300, "cuda")
    layer = gpu_caches[0]
    for tensor in (layer.key, layer.value):
        tensor.copy_(torch.randn(tensor.shape, generator=generator).round())
    index_keys = torch.randn(layer.index_key.shape, generator=generator).round().cuda()
    if index_dtype is None:
        layer.index_key.copy_(index_keys)
    else:
        layer.index_key[:], layer.index_key_scale[:] = quantize_index_keys(index_keys)
    ref_caches = [LayerKVCache(layer.key.clone(), layer.value.clone(), layer.index_key.clone(),
                               None if layer.index_key_scale is None else layer.index_key_scale.clone())]  # fmt: skip
    gpu = GpuAttentionBackend(gpu_caches, topk_blocks=SHAPE.topk, local_blocks=SHAPE.local_blocks,
                              num_q_heads=SHAPE.num_q_heads, decode_tuning=tuning)  # fmt: skip
    ref = ReferenceAttentionBackend(ref_caches, topk_blocks=SHAPE.topk, local_blocks=SHAPE.local_blocks)
    pages = torch.randperm(299, generator=generator)[:270].view(3, 90).cuda() + 1
    done = {0: 5000, 1: 129, 2: 11000}
    for _ in range(3):
        metadata = step_metadata({0: 1, 1: 1, 2: 1}, done, pages, block)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(3, *shape, generator=generator).to("cuda", torch.bfloat16)

        heads, kv_heads, dim = SHAPE.num_q_heads, SHAPE.num_kv_heads, SHAPE.head_dim
        args = (randn(heads, dim), randn(kv_heads, dim), randn(kv_heads, dim), randn(kv_heads, dim).round(),
                randn(dim).round())  # fmt: skip
        outputs = []
        for backend in (gpu, ref):
            backend.begin_step(metadata)
            outputs.append(backend.sparse(0, *args))
        torch.testing.assert_close(outputs[0].float(), outputs[1].float(), atol=OUT_TOLERANCE, rtol=OUT_TOLERANCE)
        for request in done:
            done[request] += 1


def test_backend_matches_reference_backend_over_steps() -> None:
    """Prefill chunks (MSA prefill kernels, FlashInfer dense prefill), decode and MTP-like steps
    (decode indexer, FlashInfer flattened decode and dense decode) at M3 dims, bf16."""
    block = SHAPE.block_size
    steps = [{0: 2500, 1: 700}, {0: 1000, 2: 3000}, {0: 1, 1: 1, 2: 1}, {0: 3, 1: 2, 2: 1}, {1: 1, 2: 1}]
    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim, block_size=block,
        index_head_dim=SHAPE.index_head_dim, sparse_layers=(False, True), dtype=torch.bfloat16,
    )  # fmt: skip

    def caches() -> list:
        layers = allocate_kv_cache(spec, 120, "cuda")
        for layer in layers:
            for tensor in (layer.key, layer.value, layer.index_key):
                if tensor is not None:
                    tensor.fill_(float("nan"))
        return layers

    generator = torch.Generator().manual_seed(5)
    pages = torch.randperm(120, generator=generator)[:105].view(3, 35).cuda()
    gpu = GpuAttentionBackend(caches(), topk_blocks=SHAPE.topk, local_blocks=SHAPE.local_blocks,
                              num_q_heads=SHAPE.num_q_heads)  # fmt: skip
    assert gpu.use_flashinfer, "the GPU suite runs with FlashInfer installed"
    ref = ReferenceAttentionBackend(caches(), topk_blocks=SHAPE.topk, local_blocks=SHAPE.local_blocks)
    done = {0: 0, 1: 0, 2: 0}
    for step in steps:
        metadata = step_metadata(step, done, pages, block)

        def randn(*shape: int, tokens: int = metadata.num_tokens) -> torch.Tensor:
            return torch.randn(tokens, *shape, generator=generator).to("cuda", torch.bfloat16)

        heads, kv_heads, dim = SHAPE.num_q_heads, SHAPE.num_kv_heads, SHAPE.head_dim
        dense_args = (randn(heads, dim), randn(kv_heads, dim), randn(kv_heads, dim))
        # Small-integer index vectors: scores are exact in any summation order, so both backends face
        # the same (frequent) exact ties and must both break them towards the lower block id.
        sparse_args = (randn(heads, dim), randn(kv_heads, dim), randn(kv_heads, dim), randn(kv_heads, dim).round(),
                       randn(dim).round())  # fmt: skip
        outputs = []
        for backend in (gpu, ref):
            backend.begin_step(metadata)
            outputs.append((backend.dense(0, *dense_args), backend.sparse(1, *sparse_args)))
        (gpu_dense, gpu_sparse), (ref_dense, ref_sparse) = outputs
        tolerance = OUT_TOLERANCE if metadata.max_query_len * kv_heads <= MAX_DECODE_COLUMNS else PREFILL_TOLERANCE
        torch.testing.assert_close(gpu_dense.float(), ref_dense.float(), atol=OUT_TOLERANCE, rtol=OUT_TOLERANCE)
        torch.testing.assert_close(gpu_sparse.float(), ref_sparse.float(), atol=tolerance, rtol=tolerance)
        for request, new in step.items():
            done[request] += new


def test_backend_decode_graph_replays_a_later_step() -> None:
    """As engine.runtime.cuda_graphs does: plan a pure-decode step over fixed buffers, capture the
    dense and MSA layers once, then stage a step with other contexts into the same buffers, plan it
    (host only) and replay: the result must match the reference backend on that later step."""
    block, width, num_pages = SHAPE.block_size, 80, 400
    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim, block_size=block,
        index_head_dim=SHAPE.index_head_dim, sparse_layers=(False, True), dtype=torch.bfloat16,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(77)

    def random_like(tensor: torch.Tensor, integers: bool = False) -> torch.Tensor:
        values = torch.randn(tensor.shape, generator=generator)
        return values.round() if integers else values  # integer index vectors: exact scores, exact ties

    gpu_caches = allocate_kv_cache(spec, num_pages, "cuda")
    for layer in gpu_caches:
        layer.key.copy_(random_like(layer.key))
        layer.value.copy_(random_like(layer.value))
        if layer.index_key is not None:
            layer.index_key.copy_(random_like(layer.index_key, integers=True))
    ref_caches = [
        LayerKVCache(
            layer.key.clone(), layer.value.clone(), None if layer.index_key is None else layer.index_key.clone()
        )
        for layer in gpu_caches
    ]
    gpu = GpuAttentionBackend(gpu_caches, topk_blocks=SHAPE.topk, local_blocks=SHAPE.local_blocks,
                              num_q_heads=SHAPE.num_q_heads)  # fmt: skip
    ref = ReferenceAttentionBackend(ref_caches, topk_blocks=SHAPE.topk, local_blocks=SHAPE.local_blocks)
    pages = torch.randperm(num_pages - 1, generator=generator)[: 3 * width].view(3, width).cuda() + 1
    heads, kv_heads, dim = SHAPE.num_q_heads, SHAPE.num_kv_heads, SHAPE.head_dim
    # Persistent layer inputs and metadata tensors, like the runner's padded decode buffers.
    dense_in = [torch.empty(3, *shape, dtype=torch.bfloat16, device="cuda")
                for shape in ((heads, dim), (kv_heads, dim), (kv_heads, dim))]  # fmt: skip
    sparse_in = [torch.empty(3, *shape, dtype=torch.bfloat16, device="cuda")
                 for shape in ((heads, dim), (kv_heads, dim), (kv_heads, dim), (kv_heads, dim), (dim,))]  # fmt: skip
    fixed = step_metadata({0: 1, 1: 1, 2: 1}, {0: 299, 1: 4999, 2: 69}, pages, block)
    device_fields = ("query_start_loc", "seq_lens", "positions", "slot_mapping", "page_table")

    def stage(done: dict[int, int]) -> None:
        """A new decode step into the fixed tensors, fresh layer inputs, both backends planned."""
        step = step_metadata({0: 1, 1: 1, 2: 1}, done, pages, block)
        for name in device_fields:
            getattr(fixed, name).copy_(getattr(step, name))
        fixed.seq_lens_cpu.copy_(step.seq_lens_cpu)
        for tensor in dense_in + sparse_in[:3]:
            tensor.copy_(random_like(tensor))
        for tensor in sparse_in[3:]:
            tensor.copy_(random_like(tensor, integers=True))
        ref.begin_step(fixed)
        gpu.begin_step(fixed)

    def layers(backend: GpuAttentionBackend | ReferenceAttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        return backend.dense(0, *dense_in), backend.sparse(1, *sparse_in)

    stage({0: 299, 1: 4999, 2: 69})
    layers(ref)
    layers(gpu)  # warm-up outside the capture (compiles); stores the same keys as the reference did
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layers(gpu)  # recorded, not run
    stage({0: 9000, 1: 120, 2: 6001})
    want = layers(ref)
    graph.replay()
    torch.cuda.synchronize()
    for expected, actual in zip(want, captured, strict=True):
        torch.testing.assert_close(actual.float(), expected.float(), atol=OUT_TOLERANCE, rtol=OUT_TOLERANCE)


def test_scaled_fp8_index_keys_select_what_the_reference_selects_from_them(batch) -> None:
    """The engine's fp8 k-index (e4m3 keys and a float32 scale per token in the same pages) at M3 dims."""
    paged, _, index_q = batch
    fp8 = with_fp8_index(paged)
    plan = plan_sparse_decode(paged.metadata, SHAPE, torch.device("cuda"))
    selected = decode_index_topk(index_q, fp8.index_key_cache, paged.metadata, plan, DecodeTuning().fp8_scan,
                                 index_key_scale=fp8.index_key_scale)  # fmt: skip
    check_selection(fp8, index_q, selected)


@pytest.mark.parametrize(
    "config",
    [ScanConfig(), ScanConfig(1, 4, 4, page_ids_ahead=True), ScanConfig(1, 4, 5, page_ids_ahead=True)],
    ids=["default", "page-ids-ahead-4-stages", "page-ids-ahead-5-stages"],
)
def test_fp8_index_keys_select_what_the_reference_selects_from_them(batch, config: ScanConfig) -> None:
    paged, _, index_q = batch
    metadata = paged.metadata
    fp8 = dataclasses.replace(
        paged,
        index_key_cache=paged.index_key_cache.to(torch.float8_e4m3fn),
        index_keys=[keys.to(torch.float8_e4m3fn).bfloat16() for keys in paged.index_keys],
    )
    plan = plan_sparse_decode(metadata, SHAPE, torch.device("cuda"))
    selected = decode_index_topk(index_q, fp8.index_key_cache, metadata, plan, config)
    check_selection(fp8, index_q, selected)
