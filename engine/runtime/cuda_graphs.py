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

A parallel engine's ranks capture and replay together (``GraphPeers``, rank 0's side in
``engine.distributed.leader``): each rank holds the same padded buffers and captures its own shard's forward,
collectives included, size by size in the same order; rank 0 keeps its graphs only if every rank captured all
sizes.  A replay on rank 0 first hands the workers the staged step (its buffers' device blocks and host context
lengths), and each worker plans it and replays its graph of that size, so the graphs' collectives meet.
"""

import logging
from typing import Protocol

import torch

from m3stack.engine.attention.backend import AttentionBackend
from m3stack.engine.kv_cache.block_pool import NULL_BLOCK_ID
from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.runtime.inputs import HostInputs

logger = logging.getLogger(__name__)


def _round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_batch``."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch} | set(range(16, max_batch + 1, 16)) | {max_batch}
    return sorted(sizes)


class PaddedDecodeBuffers:
    """Persistent inputs of padded decode batches and the ``AttentionMetadata`` views over them.

    The device inputs are views of two blocks, int64 (input ids, positions, slots) and int32 (context
    lengths, then the page table), each mirrored by a pinned host block: a step writes its rows into
    the mirrors with numpy and goes up in two asynchronous copies (a copy from pageable memory may wait
    for the step in flight).  The caller must not restage before the previous step's copies ran
    (``ModelRunner`` waits on an event for that).
    """

    def __init__(self, device: torch.device, *, block_size: int, max_batch: int, max_model_len: int) -> None:
        self.device = device
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_pages = -(-max_model_len // block_size)
        pin = device.type == "cuda"
        # Every view starts 16-byte aligned, as an eager step's freshly uploaded inputs do: Triton compiles a kernel
        # variant per pointer alignment, so a view at another offset (the page table after one context length, the
        # positions after one id) would make the graphs' kernels differ from the eager ones, and the first eager
        # decode step would compile its own variants mid-serving (seconds; seen after a long prefill).
        wide = torch.zeros((3, _round_up(max_batch, 2)), dtype=torch.int64)  # rows of 2 x 8 bytes
        wide[2] = -1  # padding rows: slot -1, never stored
        self._table_offset = _round_up(max_batch, 4)  # 4 x 4 bytes
        narrow = torch.full((self._table_offset + max_batch * self.max_pages,), NULL_BLOCK_ID, dtype=torch.int32)
        narrow[:max_batch] = 1  # padding rows: context 1 on the null page
        self._wide_host = wide.pin_memory() if pin else wide
        self._narrow_host = narrow.pin_memory() if pin else narrow
        self._wide = self._wide_host.to(device, copy=True)
        self._narrow = self._narrow_host.to(device, copy=True)
        self.input_ids, self.positions, self.slot_mapping = (row[:max_batch] for row in self._wide.unbind(0))
        self.seq_lens = self._narrow[:max_batch]
        self.page_table = self._narrow[self._table_offset :].view(max_batch, self.max_pages)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.query_start_loc_cpu = torch.arange(max_batch + 1, dtype=torch.int32)
        self._ids_host = self._wide_host.numpy()
        self._seq_lens_host = self._narrow_host[:max_batch].numpy()
        self._table_host = self._narrow_host[self._table_offset :].view(max_batch, self.max_pages).numpy()
        self._table_width = 0  # columns of the host page table that may hold real pages

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
        count, width = len(host.seq_lens), host.page_table.shape[1]
        ids = self._ids_host
        ids[0, :count] = host.input_ids
        ids[1, :count] = host.positions
        ids[2, :count] = host.slot_mapping
        ids[0:2, count:size] = 0
        ids[2, count:size] = -1
        self._seq_lens_host[:count] = host.seq_lens
        self._seq_lens_host[count:size] = 1
        table = self._table_host
        table[:size, : max(width, self._table_width)] = NULL_BLOCK_ID  # what a wider earlier batch left
        table[:count, :width] = host.page_table
        self._table_width = max(width, self._table_width)
        self._wide.copy_(self._wide_host, non_blocking=True)
        used = self._table_offset + size * self.max_pages
        self._narrow[:used].copy_(self._narrow_host[:used], non_blocking=True)
        return self.metadata(size)

    def step_blocks(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device blocks that hold a staged step of ``size`` rows (what a parallel engine's workers receive)."""
        return self._wide, self._narrow[: self._table_offset + size * self.max_pages]

    def host_seq_lens(self, size: int) -> torch.Tensor:
        return torch.from_numpy(self._seq_lens_host[:size])

    def metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            block_size=self.block_size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            page_table=self.page_table[:size],
            query_start_loc_cpu=self.query_start_loc_cpu[: size + 1],
            seq_lens_cpu=torch.from_numpy(self._seq_lens_host[:size].copy()),
        )


class GraphPeers(Protocol):
    """The other ranks of a parallel engine, seen from one rank's ``DecodeGraphs``."""

    def begin_capture(self, graphs: "DecodeGraphs") -> None:
        """Rank 0: have every worker capture the same sizes now (a worker: nothing to do)."""
        ...

    def agree(self, captured: bool) -> bool:
        """Whether every rank captured every size (each rank says whether it did)."""
        ...

    def send_replay(self, size: int, buffers: PaddedDecodeBuffers) -> None:
        """Rank 0: hand the workers the staged step, which they replay with their graph of ``size``."""
        ...


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
        peers: GraphPeers | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.peers = peers
        self.buffers = PaddedDecodeBuffers(
            device, block_size=block_size, max_batch=max_batch, max_model_len=max_model_len
        )
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size; on any failure (e.g. a layer that synchronizes with the host, on any rank) decode
        stays eager."""
        if not getattr(self.backend, "supports_cuda_graphs", False):
            logger.warning(
                "%s does not declare supports_cuda_graphs: decode steps run eagerly", type(self.backend).__name__
            )
            return
        if self.peers is not None:
            self.peers.begin_capture(self)
        failure = self._capture_all()
        captured = failure is None
        if self.peers is not None:
            captured = self.peers.agree(captured)
        if not captured:
            self.graphs.clear()
            self.logits.clear()
            torch.cuda.synchronize()
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", failure or "on another rank")
            return
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _capture_all(self) -> str | None:
        """Capture each size, largest first; the first failure, if any.  With peers every size's eager warm-up
        forward still runs after a failure: it holds collectives the other ranks are waiting in."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        failure = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool memory
            self.backend.begin_step(self.buffers.metadata(size))
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside capture (allocator, autotuning, lazy init)
                self._forward(size)
            torch.cuda.current_stream().wait_stream(stream)
            if failure is not None:
                continue
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[size] = self._forward(size)
            except RuntimeError as exc:
                failure = str(exc)
                # The message alone rarely says which layer did it (a host copy, a sync): keep where it was raised.
                logger.warning("CUDA graph capture of batch size %d failed", size, exc_info=True)
                torch.cuda.synchronize()
                if self.peers is None:
                    return failure
                continue
            self.graphs[size] = graph
        torch.cuda.synchronize()
        return failure

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
        if self.peers is not None:
            self.peers.send_replay(size, self.buffers)
        self.graphs[size].replay()
        return self.logits[size][:num_requests]

    def replay_planned(self, size: int) -> None:
        """A worker: replay the step rank 0 put in this rank's buffers (``GraphPeers.send_replay``), planned."""
        self.graphs[size].replay()
