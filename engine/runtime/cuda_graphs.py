"""CUDA graphs for pure-decode steps: one graph per padded batch size, replayed over persistent input buffers.

A decode step of R requests is padded to the smallest captured size >= R.  Padding rows are inert:
token 0 at position 0, slot -1 (the cache store skips it), context length 1 on the reserved null
page 0, so they never touch a real request's pages.  Every step the real inputs are copied into the
same device buffers the graph was captured with, the attention backend plans the step on the host
(``begin_step``, outside the graph: FlashInfer ``plan()`` and friends), and the graph replays the
model forward and the LM head; sampling runs after it, eagerly.

The attention backend must say it can be captured (``supports_cuda_graphs = True``): its
``begin_step`` must leave every device tensor its kernels read at addresses fixed across steps of
one batch size, and launch grids that do not depend on the step's lengths.  The model's decode
forward must not synchronize with the host (capture fails if it does).  Otherwise decode runs
eagerly and a warning says why.
"""

import logging

import numpy as np
import torch

from m3stack.engine.attention.backend import AttentionBackend
from m3stack.engine.attention.metadata import AttentionMetadata
from m3stack.engine.runtime.block_pool import NULL_BLOCK_ID
from m3stack.engine.runtime.inputs import HostInputs

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_batch``."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch} | set(range(16, max_batch + 1, 16)) | {max_batch}
    return sorted(sizes)


class PaddedDecodeBuffers:
    """Persistent inputs of padded decode batches and the ``AttentionMetadata`` views over them."""

    def __init__(self, device: torch.device, *, block_size: int, max_batch: int, max_model_len: int) -> None:
        self.device = device
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_pages = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.page_table = torch.full((max_batch, self.max_pages), NULL_BLOCK_ID, dtype=torch.int32, device=device)
        self.query_start_loc_cpu = torch.arange(max_batch + 1, dtype=torch.int32)
        # Host staging for one copy per tensor per step (pinned on cuda, so the copies are asynchronous).
        pin = device.type == "cuda"
        self._staged = torch.empty((4, max_batch), dtype=torch.int64, pin_memory=pin)
        self._seq_lens_cpu = torch.ones(max_batch, dtype=torch.int32)

    def fits(self, host: HostInputs) -> bool:
        num_requests = len(host.seq_lens)
        return (
            0 < num_requests <= self.max_batch
            and len(host.input_ids) == num_requests
            and len(host.logits_rows) == num_requests
            and host.page_table.shape[1] <= self.max_pages
            and not host.mm_slices
        )

    def stage(self, host: HostInputs, size: int) -> AttentionMetadata:
        """Copy a decode step of R <= ``size`` requests into the buffers, padding rows R..size-1."""
        count = len(host.seq_lens)
        staged = self._staged[:, :size]
        staged[0, :count] = torch.from_numpy(host.input_ids)
        staged[1, :count] = torch.from_numpy(host.positions)
        staged[2, :count] = torch.from_numpy(host.slot_mapping)
        staged[3, :count] = torch.from_numpy(host.seq_lens.astype(np.int64))
        staged[0:2, count:] = 0
        staged[2, count:] = -1
        staged[3, count:] = 1
        on_device = staged.to(self.device, non_blocking=True)
        self.input_ids[:size].copy_(on_device[0])
        self.positions[:size].copy_(on_device[1])
        self.slot_mapping[:size].copy_(on_device[2])
        self.seq_lens[:size].copy_(on_device[3])
        self.page_table[:size].fill_(NULL_BLOCK_ID)
        width = host.page_table.shape[1]
        self.page_table[:count, :width].copy_(torch.from_numpy(host.page_table), non_blocking=True)
        self._seq_lens_cpu[:count] = torch.from_numpy(host.seq_lens)
        self._seq_lens_cpu[count:size] = 1
        return self.metadata(size)

    def metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            block_size=self.block_size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            page_table=self.page_table[:size],
            query_start_loc_cpu=self.query_start_loc_cpu[: size + 1],
            seq_lens_cpu=self._seq_lens_cpu[:size].clone(),
        )


class DecodeGraphs:
    def __init__(
        self,
        model,
        backend: AttentionBackend,
        device: torch.device,
        *,
        block_size: int,
        max_batch: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.buffers = PaddedDecodeBuffers(
            device, block_size=block_size, max_batch=max_batch, max_model_len=max_model_len
        )
        self.sizes = capture_sizes(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size; on any failure (e.g. a layer that synchronizes with the host) decode stays eager."""
        if not getattr(self.backend, "supports_cuda_graphs", False):
            logger.warning(
                "%s does not declare supports_cuda_graphs: decode steps run eagerly", type(self.backend).__name__
            )
            return
        try:
            self._capture_all()
        except RuntimeError as exc:
            self.graphs.clear()
            self.logits.clear()
            torch.cuda.synchronize()
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", exc)
            return
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool memory
            self.backend.begin_step(self.buffers.metadata(size))
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside capture (allocator, autotuning, lazy init)
                self._forward(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def _forward(self, size: int) -> torch.Tensor:
        buffers = self.buffers
        hidden = self.model.forward(buffers.input_ids[:size], buffers.positions[:size], self.backend, None, None)
        return self.model.compute_logits(hidden)

    def prepare(self, host: HostInputs) -> int | None:
        """Stage a decode step and plan its attention; the padded size to replay, or None when not graph-able."""
        if not self.graphs or not self.buffers.fits(host):
            return None
        size = next(s for s in self.sizes if s >= len(host.seq_lens))
        self.backend.begin_step(self.buffers.stage(host, size))
        return size

    def replay(self, size: int, num_requests: int) -> torch.Tensor:
        """Logits ``[num_requests, V]`` of the step staged by ``prepare``."""
        self.graphs[size].replay()
        return self.logits[size][:num_requests]
