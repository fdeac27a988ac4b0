"""MSA sparse decode attention over the pages the decode indexer selected.

Primary path: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` over the per-KV-head flattened
view (docs/msa.md#cache-layout): rows ``(token, KV head)`` become MQA requests with ``G = Hq / Hkv`` query
heads and one KV head, the HND caches are viewed as ``[num_pages * Hkv, 1, B, D]`` (free), each
row's page list is its selected virtual pages with the local page last, and ``last_page_len``
makes the local page causal.  ``plan()`` runs once per step on the host from host-known lengths
(``SparseDecodePlan``); the page ids are written on the device by the indexer, into the buffer
the plan already points FlashInfer at, so every sparse layer of the step reuses the plan.

The Triton split-K kernel of ``paged_attention`` over the same page lists, with the splits of each
row combined by the row's last program (one launch, no host planning), serves where FlashInfer is
absent (CPU interpretation, other GPUs) and wherever it is faster: a decode row reads only 16 pages,
so the layer's cost is latency, not bandwidth (bench/msa_decode.py times both).
"""

import importlib.util
import logging
from dataclasses import dataclass

import torch

from m3stack.engine.msa.decode_plan import DecodePlanBuffers, SparseDecodePlan
from m3stack.engine.msa.paged_attention import PageRows, check_out, check_paged_inputs, paged_attention

logger = logging.getLogger(__name__)

# FlashInfer's recommended split-K workspace.
WORKSPACE_BYTES = 128 * 2**20


@dataclass(frozen=True)
class TritonDecodeConfig:
    """Launch shape of the Triton sparse decode attention (bench/msa_decode.py sweeps these)."""

    pages_per_split: int | None = None  # None: ~2 programs per SM over all rows' pages
    num_warps: int = 4
    num_stages: int | None = None  # None: Triton's default
    fused_combine: bool = True  # combine each row's splits in its last program (else a second launch)
    # Launched with programmatic dependent launch (sm_90+): its programs start while the indexer runs and read the
    # page ids once it has finished (``paged_attention``'s ``pdl``).
    pdl: bool = True


def flashinfer_available(device: torch.device) -> bool:
    """FlashInfer serves CUDA devices when the package is installed (it JIT-compiles on first use)."""
    return device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None


class FlashInferSparseDecode:
    """FlashInfer paged decode over the flattened (token, KV head) rows of a ``SparseDecodePlan``."""

    def __init__(
        self,
        device: torch.device,
        workspace: torch.Tensor | None = None,
        buffers: DecodePlanBuffers | None = None,
    ) -> None:
        """With ``buffers``, FlashInfer runs in its CUDA-graph mode over them (plans of that token count only)."""
        import flashinfer  # lazily: absent on CPU hosts and in CI

        self._workspace = workspace if workspace is not None else torch.zeros(
            WORKSPACE_BYTES, dtype=torch.uint8, device=device
        )  # fmt: skip
        self._buffers = buffers
        # Group size 16 (M3) is served only by the tensor-core (prefill-kernel) decode path.
        if buffers is None:
            self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "HND", use_tensor_cores=True)
        else:
            self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "HND", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=buffers.row_indptr, paged_kv_indices_buffer=buffers.page_ids,
                paged_kv_last_page_len_buffer=buffers.last_page_len,
            )  # fmt: skip
        self._plan: SparseDecodePlan | None = None

    def plan(self, plan: SparseDecodePlan, dtype: torch.dtype, scale: float) -> None:
        """Host-side planning for a step; ``plan.page_ids`` is read by ``run`` after the indexer fills it."""
        shape = plan.shape
        if self._buffers is not None and plan.page_ids is not self._buffers.page_ids:
            raise ValueError("a CUDA-graph FlashInferSparseDecode plans only over its own DecodePlanBuffers")
        self._plan = plan
        if plan.num_rows == 0:
            return
        self._wrapper.plan(
            plan.row_indptr_cpu,
            plan.page_ids[: int(plan.row_indptr_cpu[-1])],
            plan.last_page_len_cpu,
            num_qo_heads=shape.num_q_heads // shape.num_kv_heads,
            num_kv_heads=1,
            head_dim=shape.head_dim,
            page_size=shape.block_size,
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=scale,
        )

    def run(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("FlashInferSparseDecode.run() before plan()")
        if plan.num_rows == 0:
            return out
        shape = plan.shape
        group = shape.num_q_heads // shape.num_kv_heads
        pages, num_kv_heads, block_size, head_dim = key_cache.shape
        flat = (pages * num_kv_heads, 1, block_size, head_dim)
        self._wrapper.run(
            q.contiguous().view(plan.num_rows, group, head_dim),
            (key_cache.view(flat), value_cache.view(flat)),
            out=out.view(plan.num_rows, group, head_dim),
        )
        return out


def sparse_rows(plan: SparseDecodePlan, positions: torch.Tensor, page_table: torch.Tensor) -> PageRows:
    """The plan's rows for the Triton fallback (the same page lists FlashInfer reads)."""
    return PageRows(
        token_request=plan.token_request,
        positions=positions,
        page_table=page_table,
        row_indptr=plan.row_indptr,
        page_ids=plan.page_ids,
        last_len=plan.last_page_len,
        max_pages=plan.max_row_pages,
    )


def check_sparse_decode_inputs(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               plan: SparseDecodePlan) -> None:  # fmt: skip
    check_paged_inputs(q, key_cache, value_cache)
    shape = plan.shape
    expected = (plan.num_tokens, shape.num_q_heads, shape.head_dim)
    if q.shape != expected:
        raise ValueError(f"q has shape {tuple(q.shape)}, expected {expected}")
    if key_cache.shape[1:] != (shape.num_kv_heads, shape.block_size, shape.head_dim):
        raise ValueError(f"cache pages {tuple(key_cache.shape[1:])} do not match the plan's {shape}")
    if not key_cache.is_contiguous():
        raise ValueError("the flattened decode view needs contiguous HND caches")


def sparse_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: SparseDecodePlan,
    positions: torch.Tensor,
    page_table: torch.Tensor,
    scale: float,
    flashinfer_decode: FlashInferSparseDecode | None = None,
    out: torch.Tensor | None = None,
    triton_config: TritonDecodeConfig | None = None,
) -> torch.Tensor:
    """Attention of each new token over its selected pages: ``[T, Hq, D]`` in q's dtype.

    Call after ``decode_index_topk`` filled ``plan.page_ids`` for this layer.  With
    ``flashinfer_decode`` (planned for this step) FlashInfer runs, otherwise the Triton kernel.
    """
    check_sparse_decode_inputs(q, key_cache, value_cache, plan)
    out = check_out(out, q)
    if flashinfer_decode is not None:
        if not out.is_contiguous():
            raise ValueError("FlashInfer writes a contiguous output")
        return flashinfer_decode.run(q, key_cache, value_cache, out)
    config = triton_config or TritonDecodeConfig()
    return paged_attention(
        q, key_cache, value_cache, sparse_rows(plan, positions, page_table), scale,
        pages_per_split=config.pages_per_split, num_warps=config.num_warps, num_stages=config.num_stages, out=out,
        counters=plan.attention_counters if config.fused_combine else None, pdl=config.pdl,
    )  # fmt: skip
