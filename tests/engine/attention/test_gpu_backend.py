"""The GPU attention backend (Triton paths, interpreted on CPU) against the reference backend, over a
sequence of steps that store into and read back from the paged cache: chunked prefill, a mixed
step, plain decode and multi-token (MTP-like) decode, on a dense and an MSA layer."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest
import torch

from m3stack.engine.attention import gpu as gpu_backend
from m3stack.engine.attention.flashinfer_dense import FLASHINFER_HEAD_DIMS
from m3stack.engine.attention.gpu import GpuAttentionBackend
from m3stack.engine.attention.reference import ReferenceAttentionBackend
from m3stack.engine.kv_cache.tensors import KVCacheSpec, allocate_kv_cache
from m3stack.engine.msa.decode_index import ScanConfig
from m3stack.engine.msa.decode_tuning import DecodeTuning
from tests.engine.attention.step_support import step_metadata

BLOCK, HQ, HKV, HEAD_DIM, INDEX_DIM, TOPK, LOCAL = 16, 8, 2, 32, 16, 3, 1
NUM_PAGES = 24
# Each step: {request: new tokens}; more than 32 new tokens of a request send the MSA layer to the
# prefill path (32 x Hkv columns is the decode indexer's limit).  Contexts reach 5-6 blocks, so
# top-3 selection really drops blocks.
STEPS = [
    {0: 34, 1: 3},  # prefill chunk + a short prompt (MSA prefill path)
    {0: 40},  # the rest of request 0 (prefill path, starts mid-block)
    {0: 1, 1: 1},  # decode (MSA decode path, pure decode for the dense layer)
    {0: 3, 1: 2, 2: 1},  # several tokens per request and a new 1-token prompt (decode path)
    {1: 1, 2: 1},  # decode with one request finished
]


def caches(index_dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None) -> list:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=HKV, head_dim=HEAD_DIM, block_size=BLOCK, index_head_dim=INDEX_DIM,
                       sparse_layers=(False, True), dtype=torch.float32, index_dtype=index_dtype,
                       kv_dtype=kv_dtype)  # fmt: skip
    layers = allocate_kv_cache(spec, NUM_PAGES, "cpu")
    for layer in layers:
        for tensor in (layer.key, layer.value, layer.index_key, layer.index_key_scale):
            if tensor is not None:
                tensor.fill_(float("nan"))  # only written slots may ever be read
    return layers


def run_and_compare(steps: list[dict[int, int]], num_q_heads: int | None, seed: int,
                    tuning: DecodeTuning | None = None, index_dtype: torch.dtype | None = None,
                    kv_dtype: torch.dtype | None = None) -> GpuAttentionBackend:  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    # Three requests of up to 8 pages each, scattered over the pool.
    pages = torch.randperm(NUM_PAGES, generator=generator)[:24].view(3, 8)
    gpu = GpuAttentionBackend(caches(index_dtype, kv_dtype), topk_blocks=TOPK, local_blocks=LOCAL,
                              num_q_heads=num_q_heads, decode_tuning=tuning)  # fmt: skip
    ref = ReferenceAttentionBackend(caches(index_dtype, kv_dtype), topk_blocks=TOPK, local_blocks=LOCAL)
    done = {0: 0, 1: 0, 2: 0}
    for step in steps:
        metadata = step_metadata(step, done, pages, BLOCK)

        def randn(*shape: int, tokens: int = metadata.num_tokens) -> torch.Tensor:
            values = torch.randn(tokens, *shape, generator=generator)
            # An fp8 KV cache: values e4m3 holds exactly (the Triton interpreter's fp32 -> e4m3 rounding is wrong
            # where it rounds up into the next power of two, see tests/engine/msa/test_store.py).
            return values if kv_dtype is None else values.to(kv_dtype).float()

        dense_args = (randn(HQ, HEAD_DIM), randn(HKV, HEAD_DIM), randn(HKV, HEAD_DIM))
        # Small-integer index vectors: scores are exact in any summation order, so both backends face
        # the same (frequent) exact ties and must both break them towards the lower block id.
        sparse_args = (randn(HQ, HEAD_DIM), randn(HKV, HEAD_DIM), randn(HKV, HEAD_DIM),
                       randn(HKV, INDEX_DIM).round(), randn(INDEX_DIM).round())  # fmt: skip
        outputs = []
        for backend in (gpu, ref):
            backend.begin_step(metadata)
            outputs.append((backend.dense(0, *dense_args), backend.sparse(1, *sparse_args)))
        (gpu_dense, gpu_sparse), (ref_dense, ref_sparse) = outputs
        torch.testing.assert_close(gpu_dense, ref_dense, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(gpu_sparse, ref_sparse, atol=2e-5, rtol=2e-5)
        for request, new in step.items():
            done[request] += new
    return gpu


def test_gpu_backend_matches_reference_backend_over_steps() -> None:
    run_and_compare(STEPS, num_q_heads=HQ, seed=17)


def test_gpu_backend_with_the_shared_page_scan_matches_reference_backend_over_steps() -> None:
    """Uniform splits, the shared-page kernel storing the decode steps' keys, and its own merge launch."""
    run_and_compare(STEPS, num_q_heads=HQ, seed=19, tuning=DecodeTuning(scan=ScanConfig(shared_pages=True)))


@pytest.mark.parametrize("shared_pages", [False, True], ids=["per-request-scan", "shared-page-scan"])
def test_gpu_backend_with_the_attention_selecting_its_pages_matches_reference_backend_over_steps(
    shared_pages: bool,
) -> None:
    """The decode steps' merge inside the attention (``msa.decode_fused``), after the scan that stored the keys."""
    tuning = DecodeTuning(scan=ScanConfig(shared_pages=shared_pages), select_in_attention_min_requests=1)
    run_and_compare(STEPS, num_q_heads=HQ, seed=23, tuning=tuning)


@pytest.mark.parametrize("select_from", [None, 1], ids=["merge-launch", "select-in-attention"])
def test_gpu_backend_over_an_fp8_k_index_matches_reference_backend_over_steps(select_from: int | None) -> None:
    """``--index-dtype fp8_e4m3``: the stores quantize each index key with its scale (the scan's fused store in
    decode steps), the prefill and decode indexers score the scaled keys, the reference scores the dequantized."""
    run_and_compare(STEPS, num_q_heads=HQ, seed=29, tuning=DecodeTuning(select_in_attention_min_requests=select_from),
                    index_dtype=torch.float8_e4m3fn)  # fmt: skip


@pytest.mark.parametrize("select_from", [None, 2], ids=["merge-launch", "select-in-attention"])
def test_gpu_backend_over_an_fp8_kv_cache_matches_reference_backend_over_steps(select_from: int | None) -> None:
    """``--kv-cache-dtype fp8_e4m3`` (with an fp8 k-index too): every kernel widens the K/V tiles it reads, dense
    layers take the Triton paged kernel (FlashInfer reads half-precision caches only)."""
    tuning = DecodeTuning(select_in_attention_min_requests=select_from)
    gpu = run_and_compare(STEPS, num_q_heads=HQ, seed=31, tuning=tuning, index_dtype=torch.float8_e4m3fn,
                          kv_dtype=torch.float8_e4m3fn)  # fmt: skip
    assert not gpu.use_flashinfer


def test_plan_made_at_the_first_layer_without_num_q_heads() -> None:
    run_and_compare([{0: 20, 1: 5}, {0: 1, 1: 1}], num_q_heads=None, seed=4)


def test_bad_steps_are_refused() -> None:
    gpu = GpuAttentionBackend(caches(), topk_blocks=TOPK, local_blocks=LOCAL, num_q_heads=HQ)
    pages = torch.arange(24).view(3, 8)
    metadata = step_metadata({0: 5}, {0: 0}, pages, BLOCK)
    q, k = torch.randn(5, HQ, HEAD_DIM), torch.randn(5, HKV, HEAD_DIM)
    with pytest.raises(RuntimeError, match="begin_step"):
        gpu.dense(0, q, k, k)
    gpu.begin_step(metadata)
    with pytest.raises(ValueError, match="not an MSA layer"):
        gpu.sparse(0, q, k, k, torch.randn(5, HKV, INDEX_DIM), torch.randn(5, INDEX_DIM))
    with pytest.raises(ValueError, match="cache holds"):
        gpu.dense(0, q.double(), k, k)
    bad = step_metadata({0: 5}, {0: 0}, pages, BLOCK)
    bad.seq_lens_cpu[0] = 3
    with pytest.raises(ValueError, match="more tokens than their context"):
        gpu.begin_step(bad)
    with pytest.raises(ValueError, match="runs on CUDA"):
        os.environ["TRITON_INTERPRET"] = "0"
        try:
            GpuAttentionBackend(caches(), topk_blocks=TOPK, local_blocks=LOCAL)
        finally:
            os.environ["TRITON_INTERPRET"] = "1"


def test_flashinfer_is_refused_where_it_has_no_kernels() -> None:
    with pytest.raises(ValueError, match="float16/bfloat16"):
        GpuAttentionBackend(caches(), topk_blocks=TOPK, local_blocks=LOCAL, use_flashinfer=True)
    half = caches()
    for layer in half:
        layer.key, layer.value = layer.key.bfloat16(), layer.value.bfloat16()
    assert HEAD_DIM not in FLASHINFER_HEAD_DIMS
    with pytest.raises(ValueError, match="head dims"):
        GpuAttentionBackend(half, topk_blocks=TOPK, local_blocks=LOCAL, use_flashinfer=True)


def test_decode_buffers_per_batch_size_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pure-decode steps plan into buffers kept per batch size (for CUDA graphs); eager decode over
    ever new sizes must not keep them all, and reused or re-created buffers still give exact results."""
    monkeypatch.setattr(gpu_backend, "_MAX_DECODE_SLOTS", 2)
    steps = [{0: 6, 1: 3, 2: 2}, {0: 1}, {0: 1, 1: 1}, {0: 1, 1: 1, 2: 1}, {0: 1}, {1: 1, 2: 1}]
    backend = run_and_compare(steps, num_q_heads=HQ, seed=6)
    assert len(backend._decode_slots) == 2


def test_one_request_decode_merges_in_its_own_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode batch of one request takes ``DecodeTuning.single_request_merge_warps``; larger ones leave the merge to
    the attention (``select_in_attention_min_requests``), or, with that off, the fused merge; all give the reference
    backend's outputs."""
    seen = []
    real_merge, real_scan = gpu_backend.decode_index_topk, gpu_backend.scan_index_pages

    def merging(index_q, index_key, metadata, plan, scan, *args):
        seen.append(("merge", metadata.num_requests, scan.fused_merge, scan.merge_warps))
        return real_merge(index_q, index_key, metadata, plan, scan, *args)

    def scanning(index_q, index_key, metadata, plan, scan, *args):
        seen.append(("select", metadata.num_requests, scan.fused_merge))
        return real_scan(index_q, index_key, metadata, plan, scan, *args)

    monkeypatch.setattr(gpu_backend, "decode_index_topk", merging)
    monkeypatch.setattr(gpu_backend, "scan_index_pages", scanning)
    steps = [{0: 40, 1: 20}, {0: 1}, {0: 1, 1: 1}]
    run_and_compare(steps, num_q_heads=HQ, seed=8)
    assert seen == [("merge", 1, False, 1), ("select", 2, False)]
    seen.clear()
    run_and_compare(steps, num_q_heads=HQ, seed=8, tuning=DecodeTuning(select_in_attention_min_requests=None))
    assert seen == [("merge", 1, False, 1), ("merge", 2, True, 4)]
