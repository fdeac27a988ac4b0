"""M3's MoE block: sigmoid router with a selection-only correction bias, top-k experts, a shared expert.

Per token: ``s = sigmoid(W_r x)`` (float32); experts are chosen by ``s + e_score_correction_bias`` but weighted by
``s`` renormalized over the chosen k; the routed sum is multiplied by ``routed_scaling_factor`` and the shared
expert's output is added.  Experts are SwiGLU-OAI MLPs whose weights are stacked ``[E, ...]``; an MXFP8 checkpoint's
stay FP8 with ``<name>_scale_inv`` beside them (``mxfp8``), multiplied by ``mxfp8_kernels``' grouped GEMM on CUDA.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from m3stack.engine.model import fused, mxfp8, mxfp8_kernels
from m3stack.engine.model.config import TextConfig
from m3stack.engine.model.mlp import GatedMLP, swiglu_oai
from m3stack.engine.model.params import empty_parameter
from m3stack.engine.side_stream import side_stream


@dataclass(frozen=True)
class Finish:
    """What the layer does after the routed sum: ``(routed * scale).to(shared.dtype) + shared``.  ``ready``: where
    ``shared`` comes from a side stream, its event there, which the combine waits for."""

    scale: float
    shared: torch.Tensor
    ready: torch.cuda.Event | None = None

    def apply(self, routed: torch.Tensor) -> torch.Tensor:
        return (routed * self.scale).to(self.shared.dtype) + self.shared


class Router(nn.Module):
    def __init__(self, text: TextConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.top_k = text.num_experts_per_tok
        self.weight = empty_parameter(text.num_experts, text.hidden_size, dtype=dtype, device=device)
        # Kept in float32 whatever the model dtype: it only shifts sigmoid scores, which are float32.
        self.correction_bias = empty_parameter(text.num_experts, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids ``[T, k]`` int64 and their weights ``[T, k]`` float32 (one kernel after the GEMM on CUDA,
        ``fused.route``)."""
        if x.is_cuda:
            return fused.route(F.linear(x, self.weight), self.correction_bias, self.top_k)
        scores = torch.sigmoid(F.linear(x, self.weight).float())
        chosen = torch.topk(scores + self.correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        return chosen, weights / weights.sum(dim=-1, keepdim=True)


class MoE(nn.Module):
    def __init__(self, text: TextConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        experts, hidden, inter = text.num_experts, text.hidden_size, text.moe_intermediate_size
        self.alpha, self.limit = text.swiglu_alpha, text.swiglu_limit
        self.routed_scaling_factor = text.routed_scaling_factor
        self.router = Router(text, dtype=dtype, device=device)
        self.gate_up_proj = empty_parameter(experts, 2 * inter, hidden, dtype=dtype, device=device)
        self.down_proj = empty_parameter(experts, hidden, inter, dtype=dtype, device=device)
        # MXFP8 scales of the two stacks, when the checkpoint stores them so (mxfp8.quantize_parameters), and the
        # rows an expert from which those experts run dequantized through torch's grouped GEMM (grouped_dequantized).
        self.gate_up_proj_scale_inv: nn.Parameter | None = None
        self.down_proj_scale_inv: nn.Parameter | None = None
        self.dequantize_from_rows = float(mxfp8.DEQUANTIZE_FROM_ROWS_PER_EXPERT)
        self.shared_expert = GatedMLP(
            hidden, text.shared_intermediate_size, alpha=self.alpha, limit=self.limit, dtype=dtype, device=device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(routed * routed_scaling_factor).to(x.dtype) + shared``, finished by the combine (one kernel on CUDA
        instead of three launches after it)."""
        finish = self._shared_expert_beside(x)
        expert_ids, weights = self.router(x)
        return self._experts(x, expert_ids, weights, finish)

    def _shared_expert_beside(self, x: torch.Tensor) -> Finish:
        """The shared expert's output; on CUDA computed on a side stream while the router and the routed experts
        run on the current one (a CUDA graph captures both branches).  At decode sizes its few-row GEMMs leave
        most SMs idle, which the routed experts' launches fill."""
        if not x.is_cuda:
            return Finish(self.routed_scaling_factor, self.shared_expert(x))
        current, side = torch.cuda.current_stream(x.device), side_stream(x.device)
        side.wait_stream(current)  # x is written
        with torch.cuda.stream(side):
            shared = self.shared_expert(x)
            ready = side.record_event()
        shared.record_stream(current)  # its memory is reused only after the combine on the current stream
        return Finish(self.routed_scaling_factor, shared, ready)

    def _experts(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, finish: Finish | None = None
    ) -> torch.Tensor:
        """Weighted sum of each token's chosen experts, float32 ``[T, H]``; with ``finish``, the layer's output.

        Token-expert pairs are sorted by expert so each expert runs one GEMM over its tokens; each token then sums
        its rows, weighted, in slot order (no atomics: the same tokens give the same sums in any batch).
        An id of ``num_experts`` marks a pair this module does not run (another rank's expert under expert
        parallelism): such pairs sort after every expert's rows, no GEMM covers them, and they add exactly zero.
        """
        pairs = dispatch(x, expert_ids, self.gate_up_proj.shape[0])
        sorted_out = self.expert_path(x)(pairs.inputs, pairs.ends)
        owned = pairs.ends[-1]  # pairs this module ran (ids below num_experts): sorted first
        return combine_expert_rows(sorted_out, pairs.position, weights, owned, finish)

    def expert_path(self, x: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """How the experts run over activations like ``x``: a method of the expert-sorted rows and each expert's
        end row (``Dispatched``).  A step on CUDA may be captured in a CUDA graph, so its path never reads a
        device value on the host: the grouped GEMM where torch's (bf16) or the MXFP8 kernel serves the dtype, else
        every expert over every row.  The per-expert loop (exact, the least work, a host sync) is for the CPU."""
        if self._use_grouped(x):
            return self._grouped
        return self._every_expert if x.is_cuda else self._looped

    def _looped(self, inputs: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """One GEMM pair per expert that has tokens; the end rows go to the host (a sync per layer)."""
        outputs, start = [], 0
        for expert, end in enumerate(ends.tolist()):
            if end > start:
                rows = inputs[start:end]
                gate_up = mxfp8.expert_weight(self.gate_up_proj, self.gate_up_proj_scale_inv, expert, rows.dtype)
                hidden = swiglu_oai(F.linear(rows, gate_up), self.alpha, self.limit)
                down = mxfp8.expert_weight(self.down_proj, self.down_proj_scale_inv, expert, rows.dtype)
                outputs.append(F.linear(hidden, down))
                start = end
        outputs.append(inputs.new_zeros(inputs.shape[0] - start, self.down_proj.shape[1]))
        return torch.cat(outputs)

    def _every_expert(self, inputs: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Every expert over every row, each row keeping its own expert's output (rows of another rank's experts:
        zero).  E times the grouped GEMM's work, but no shape depends on the routing: the capturable path for CUDA
        activations torch's grouped GEMM does not serve (float32, the exact-comparison configuration), whose
        fallback, like the loop's end rows (``tolist``), copies device values to pageable host memory, which CUDA
        graph capture refuses ('Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor
        is pinned')."""
        # Row r's expert: the number of experts whose rows end at or before r (num_experts past the owned rows).
        rows = torch.arange(inputs.shape[0], device=inputs.device, dtype=ends.dtype)
        row_ids = torch.searchsorted(ends, rows, right=True)
        out = inputs.new_zeros(inputs.shape[0], self.down_proj.shape[1])
        for expert in range(self.gate_up_proj.shape[0]):
            gate_up = mxfp8.expert_weight(self.gate_up_proj, self.gate_up_proj_scale_inv, expert, inputs.dtype)
            down = mxfp8.expert_weight(self.down_proj, self.down_proj_scale_inv, expert, inputs.dtype)
            rows = F.linear(swiglu_oai(F.linear(inputs, gate_up), self.alpha, self.limit), down)
            out = torch.where((row_ids == expert)[:, None], rows, out)
        return out

    def _grouped(self, inputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Grouped GEMMs with device-side group offsets (the experts' end rows): no host sync, so decode steps can
        be CUDA-graphed.  Rows past the last expert's group (skipped pairs) are left unwritten; the combine ignores
        them."""
        if self.gate_up_proj_scale_inv is not None and self.down_proj_scale_inv is not None:
            routed = self.router.weight.shape[0]  # every expert, also under expert parallelism
            rows_per_expert = inputs.shape[0] / routed  # every rank's pairs under expert parallelism, over every expert
            if rows_per_expert >= self.dequantize_from_rows and not torch.cuda.is_current_stream_capturing():
                return self.grouped_dequantized(inputs, offsets)
            hidden = mxfp8_kernels.mxfp8_grouped_mm(
                inputs, self.gate_up_proj, self.gate_up_proj_scale_inv, offsets, routed_experts=routed
            )
            hidden = swiglu_oai(hidden, self.alpha, self.limit)
            return mxfp8_kernels.mxfp8_grouped_mm(
                hidden, self.down_proj, self.down_proj_scale_inv, offsets, routed_experts=routed
            )
        hidden = grouped_mm(inputs, self.gate_up_proj.transpose(1, 2), offsets)
        hidden = swiglu_oai(hidden, self.alpha, self.limit)
        return grouped_mm(hidden, self.down_proj.transpose(1, 2), offsets)

    def grouped_dequantized(self, inputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The MXFP8 experts through torch's grouped GEMM in the inputs' dtype, for steps bound by math: chunks of
        experts widened in turn (``mxfp8.widened_chunks``: the next chunk widens while this one multiplies).  Rows
        from ``offsets[-1]`` on are left unwritten, as ``_grouped`` leaves them.  One host sync for the chunks'
        rows: never graph-captured."""
        assert self.gate_up_proj_scale_inv is not None and self.down_proj_scale_inv is not None
        stacks = [(self.gate_up_proj, self.gate_up_proj_scale_inv), (self.down_proj, self.down_proj_scale_inv)]
        expert_bytes = sum(weights[0].numel() for weights, _ in stacks) * inputs.element_size()
        experts = self.gate_up_proj.shape[0]
        per_chunk = max(1, min(experts, mxfp8.DEQUANTIZE_SCRATCH_BYTES // (2 * expert_bytes)))
        ends = [0, *offsets.tolist()]
        chunks = [(first, min(first + per_chunk, experts)) for first in range(0, experts, per_chunk)]
        out = inputs.new_empty(inputs.shape[0], self.down_proj.shape[1])
        busy = [(first, last) for first, last in chunks if ends[last] > ends[first]]
        for (first, last), (gate_up, down) in mxfp8.widened_chunks(stacks, busy, inputs.dtype):
            rows = slice(ends[first], ends[last])
            group_ends = offsets[first:last] - ends[first]
            hidden = swiglu_oai(grouped_mm(inputs[rows], gate_up.transpose(1, 2), group_ends), self.alpha, self.limit)
            out[rows] = grouped_mm(hidden, down.transpose(1, 2), group_ends)
        return out

    def _use_grouped(self, x: torch.Tensor) -> bool:
        """MXFP8 experts: the Triton grouped GEMM for bf16/fp16 on CUDA; bf16 experts: ``use_grouped_mm``."""
        if self.gate_up_proj_scale_inv is not None:
            return x.is_cuda and x.dtype in mxfp8_kernels.ACTIVATION_DTYPES
        return use_grouped_mm(x)


class Dispatched(NamedTuple):
    """The flat token-expert pairs (pair ``p``: token ``p // k``, slot ``p % k``) sorted by expert id, stably."""

    inputs: torch.Tensor  # [T * k, H]: row j is the token row of the j-th pair in expert order
    position: torch.Tensor  # [T * k]: pair p's row in that order
    ends: torch.Tensor  # [E] int32: the first row whose id exceeds e (the grouped GEMMs' group offsets)


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, experts: int) -> Dispatched:
    """``x``'s rows for the pairs of ``expert_ids`` ``[T, k]``, sorted by expert; ids of ``experts`` (pairs this
    module does not run) sort last, so ``ends[-1]`` counts the pairs it runs.  On CUDA tensors one kernel for a
    decode step, ``torch.sort`` and one kernel for larger ones (``model.fused``); ``torch.sort`` and torch ops
    elsewhere."""
    if x.is_cuda:
        return Dispatched(*fused.dispatch(x, expert_ids, experts))
    row_ids, order = torch.sort(expert_ids.flatten(), stable=True)
    return Dispatched(*dispatch_sorted_eager(x, row_ids, order, expert_ids.shape[1], experts))


def dispatch_sorted_eager(
    x: torch.Tensor, row_ids: torch.Tensor, order: torch.Tensor, top_k: int, experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dispatch`` after its sort in torch ops: a gather of the rows, a scatter of their numbers, a search for each
    expert's end."""
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    ids = torch.arange(experts, device=row_ids.device, dtype=row_ids.dtype)
    return x[order // top_k], position, torch.searchsorted(row_ids, ids, right=True, out_int32=True)


def combine_expert_rows(
    rows: torch.Tensor,
    position: torch.Tensor,
    weights: torch.Tensor,
    owned: torch.Tensor,
    finish: Finish | None = None,
) -> torch.Tensor:
    """Each token's routing-weighted sum of its experts' outputs, float32 ``[T, H]``, slots summed in order; with
    a ``finish``, that applied to the sums (the layer's output, in the shared output's dtype).

    ``rows`` ``[T * k, H]`` are in expert-sorted order: flat pair ``p`` (token ``p // k``, slot ``p % k``) is row
    ``position[p]``.  Rows at or past ``owned`` (a 0-d device tensor: pairs no GEMM ran) add zero whatever they
    hold.  One kernel on CUDA tensors (``model.fused``), its torch twin elsewhere.
    """
    if rows.is_cuda:
        if finish is None:
            return fused.combine_expert_rows(rows, position, weights, owned)
        if finish.ready is not None:
            torch.cuda.current_stream(rows.device).wait_event(finish.ready)
        return fused.combine_expert_rows(rows, position, weights, owned, finish.scale, finish.shared)
    routed = combine_expert_rows_eager(rows, position, weights, owned)
    return routed if finish is None else finish.apply(routed)


def combine_expert_rows_eager(
    rows: torch.Tensor, position: torch.Tensor, weights: torch.Tensor, owned: torch.Tensor
) -> torch.Tensor:
    """``combine_expert_rows`` in torch ops: gather, mask, upcast, scale, sum (five passes over the rows)."""
    num_tokens, top_k = weights.shape
    ran = (position < owned).view(num_tokens, top_k, 1)
    picked = torch.where(ran, rows[position].view(num_tokens, top_k, -1), 0)
    return (picked.float() * weights[..., None]).sum(dim=1)


def grouped_mm(inputs: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of ``inputs`` times ``weights[e]`` (``[E, K, N]``)."""
    grouped = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return grouped(inputs, weights, offs=offsets)


def use_grouped_mm(x: torch.Tensor) -> bool:
    """torch's grouped GEMM serves bf16 on CUDA (Hopper's kernels); elsewhere the per-expert loop is exact."""
    has_kernel = hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")
    return has_kernel and x.is_cuda and x.dtype == torch.bfloat16
