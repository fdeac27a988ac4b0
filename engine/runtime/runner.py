"""Execute one scheduled step: vision encoder items, the model forward over the flat batch, sampling.

The scheduler decided everything; the runner only turns it into tensors (``inputs.py``), runs the
model, and samples on the device.  Pure-decode batches replay a captured CUDA graph when one fits
(``cuda_graphs.py``); everything else runs eagerly.

``launch`` enqueues a step's device work and returns at once; ``finish`` waits for its sampled
tokens.  Between the two the host can schedule and launch the next step (async scheduling): that
step's inputs may hold placeholders for tokens the previous step is still sampling, and the runner
fills them on the device from the previous step's output, so the host never waits for them.

Order with one step in flight (``EngineCore.step``): schedule N+1, ``launch`` N+1 (inputs, staging,
attention planning, placeholder fill, graph replay or eager forward, sampling, the copy of its tokens
to pinned memory) while the device still runs step N, then ``finish`` N, which waits on an event
after N's token copy only.  A step with grammar-constrained requests launches its forward only: its masks
depend on N's tokens, so ``sample`` builds them after ``finish`` N applied those, while the device runs
N+1's forward, and then launches N+1's sampling.  Nothing in ``launch`` may synchronize with the device: every
host-to-device copy goes from pinned memory (a pageable one may wait for the stream), and the only waits are on
events of copies the device has already reached (``_wait_inputs_consumed``).  So the host's prepare
of N+1 runs under N's forward, and the device starts N+1 as soon as N ends.
"""

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from m3stack.engine.attention.backend import AttentionBackend
from m3stack.engine.runtime.cuda_graphs import DecodeGraphs
from m3stack.engine.runtime.encoder_cache import EncoderCache
from m3stack.engine.runtime.engine_core import EncoderError
from m3stack.engine.runtime.grammar import GrammarMasks
from m3stack.engine.runtime.inputs import HostInputs, build_host_inputs, to_device
from m3stack.engine.runtime.penalties import TokenCounts
from m3stack.engine.runtime.prompt_logprobs import (
    LaunchedPromptLogprobs,
    PromptLogprobTargets,
    launch_prompt_logprobs,
    prompt_logprob_targets,
)
from m3stack.engine.runtime.request import Modality, MultimodalInput, Request, SampledToken
from m3stack.engine.runtime.sampler import DeviceSample, SamplingBatch, build_sampling_batch, sample_on_device
from m3stack.engine.runtime.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from m3stack.engine.msa.metrics import MsaMonitor
    from m3stack.engine.offload.device import DeviceOffload

logger = logging.getLogger(__name__)


class ServingModel(Protocol):
    """What the runner needs from ``engine.model`` (see its loader)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_backend: AttentionBackend,
        mm_positions: torch.Tensor | None,
        mm_embeds: torch.Tensor | None,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def encode_vision(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, modality: str) -> torch.Tensor:
        """uint8 patches are normalized by the model with the checkpoint's mean/std."""
        ...


@dataclass
class RunnerTiming:
    """Where one ``execute`` spent its time (filled when ``ModelRunner.timing`` is on)."""

    prepare_s: float = 0.0  # host: inputs, staging, attention planning, up to the forward launch
    gpu_s: float = 0.0  # device: from the forward launch to the end of sampling (CUDA events)


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued; ``ModelRunner.finish`` collects its tokens.

    ``sample`` stays None until the sampling is launched: at once, or for a step with grammar rows, by
    ``ModelRunner.sample`` once the masks are built from ``logits``."""

    sampling_requests: list[Request]
    batch: SamplingBatch | None
    sample: DeviceSample | None
    prepare_s: float
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None
    logits: torch.Tensor | None = None
    prompt_logprobs: LaunchedPromptLogprobs | None = None


class ModelRunner:
    def __init__(
        self,
        model: ServingModel,
        backend: AttentionBackend,
        encoder_cache: EncoderCache,
        *,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        dtype: torch.dtype,
        decode_graphs: DecodeGraphs | None = None,
        offload: "DeviceOffload | None" = None,
        msa: "MsaMonitor | None" = None,
        max_num_seqs: int = 256,
    ) -> None:
        self.model = model
        self.backend = backend
        self.encoder_cache = encoder_cache
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.dtype = dtype
        self.decode_graphs = decode_graphs
        self.offload = offload  # CPU KV offload: spills and hot-buffer handles before each forward
        self.msa = msa  # counts the blocks each step's MSA layers select
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        # Pure-decode steps that ran eagerly although graphs were captured (the step did not fit them): each
        # may meet kernel specializations the capture did not, so they should stay rare.
        self.num_graph_misses = 0
        # Per-step timing with CUDA events (benchmarks); off by default, it costs two event records.
        self.timing = False
        self.last_timing = RunnerTiming()
        # The last launched step's sampled tokens on the device, and the row of each request in them.
        self._previous_tokens: torch.Tensor | None = None
        self._previous_rows: dict[str, int] = {}
        # Recorded after a step's input copies were enqueued (see _wait_inputs_consumed).
        self._inputs_consumed: torch.cuda.Event | None = None
        # Penalized requests' token counts (device, persistent) and the grammar masks' buffers (made on first use).
        self.token_counts = TokenCounts(max_num_seqs, vocab_size, device)
        self.max_num_seqs = max_num_seqs
        self._grammar_masks: GrammarMasks | None = None

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Run a step to completion (launch, then finish)."""
        return self.finish(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        start = time.perf_counter()
        self._encode(out.encoder_items)
        host = build_host_inputs(out, self.block_size)
        if self.offload is not None:
            self.offload.before_step([s.request.request_id for s in out.requests], np.diff(host.query_start_loc))
        if self.msa is not None:
            self.msa.count_step(host.query_start_loc, host.seq_lens)
        events = self._events()
        targets = prompt_logprob_targets(out, host.query_start_loc)
        logits, prepare_s, prompt_logprobs = self._forward(host, start, events[0] if events else None, targets)
        if not host.sampling_requests:
            return LaunchedStep([], None, None, prepare_s, None, prompt_logprobs=prompt_logprobs)
        batch = build_sampling_batch(host.sampling_requests, self.vocab_size, self.device, self.token_counts)
        step = LaunchedStep(host.sampling_requests, batch, None, prepare_s, events, logits, prompt_logprobs)
        if batch.controls is None or not batch.controls.needs_masks:
            self._launch_sampling(step)
        return step

    @torch.inference_mode()
    def sample(self, step: LaunchedStep) -> None:
        """Launch a step's deferred sampling: build its grammar masks from the matchers as they are now (every
        earlier step's tokens applied), upload them and sample.  Nothing to do for a step already sampled."""
        if step.sample is not None or step.batch is None or step.batch.controls is None:
            return
        controls = step.batch.controls
        assert controls.grammars is not None
        if self._grammar_masks is None:
            self._grammar_masks = GrammarMasks(self.max_num_seqs, self.vocab_size, self.device)
        controls.bitmask = self._grammar_masks.fill(controls.grammars)
        self._launch_sampling(step)

    def _launch_sampling(self, step: LaunchedStep) -> None:
        assert step.batch is not None and step.logits is not None
        on_device = sample_on_device(step.logits, step.batch)
        step.logits = None
        if step.events:
            step.events[1].record()
        on_device.start_copy()  # finish() waits for this copy, not for the steps launched after this one
        step.sample = on_device
        self._previous_tokens = on_device.token_ids
        self._previous_rows = {request.request_id: row for row, request in enumerate(step.sampling_requests)}

    def finish(self, step: LaunchedStep) -> dict[str, SampledToken]:
        """Wait for a launched step's tokens (the one synchronization of a step)."""
        if step.prompt_logprobs is not None:
            step.prompt_logprobs.collect()
        if step.batch is None:
            return {}
        if step.sample is None:
            raise RuntimeError("finish() of a step whose sampling was never launched (ModelRunner.sample)")
        tokens = step.sample.to_host(step.batch)
        if self.timing:
            gpu_s = step.events[0].elapsed_time(step.events[1]) / 1e3 if step.events else 0.0
            self.last_timing = RunnerTiming(step.prepare_s, gpu_s)
        return {request.request_id: token for request, token in zip(step.sampling_requests, tokens, strict=True)}

    def _fill_placeholders(self, input_ids: torch.Tensor, host: HostInputs) -> None:
        """Write the tokens the previous step sampled into the rows that stand for them (on the device).

        The (row, source) pairs go up from pinned memory without blocking: a copy from pageable memory, or
        ``torch.tensor(..., device=...)``, waits for the stream, i.e. for the step still in flight."""
        count = len(host.placeholder_rows)
        if not count:
            return
        try:
            sources = [self._previous_rows[request_id] for request_id in host.placeholder_requests]
        except KeyError as missing:
            raise RuntimeError(f"request {missing} has a placeholder the previous step did not sample") from None
        assert self._previous_tokens is not None
        pairs = torch.empty((2, count), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        pairs[0] = torch.from_numpy(host.placeholder_rows)
        pairs[1] = torch.tensor(sources, dtype=torch.int64)
        rows, sources_on_device = pairs.to(self.device, non_blocking=True)
        input_ids.index_copy_(0, rows, self._previous_tokens.index_select(0, sources_on_device))

    def _forward(
        self, host: HostInputs, start: float, launched: torch.cuda.Event | None, targets: list[PromptLogprobTargets]
    ) -> tuple[torch.Tensor | None, float, LaunchedPromptLogprobs | None]:
        """Logits of the sampling rows (graph replay for plain decode when possible), the host prepare time, and
        the prompt logprobs of ``targets`` (prefill rows: always an eager step).

        ``launched`` is recorded right before the forward is launched, after all host-side preparation.
        """
        self._wait_inputs_consumed()
        if self.decode_graphs is not None and not host.mm_slices and not targets:
            size = self.decode_graphs.prepare(host)
            if size is not None:
                self._fill_placeholders(self.decode_graphs.buffers.input_ids, host)
                self._record_inputs_consumed()
                self.num_graph_steps += 1
                prepare_s = time.perf_counter() - start
                if launched is not None:
                    launched.record()
                return self.decode_graphs.replay(size, len(host.seq_lens)), prepare_s, None
            if len(host.input_ids) == len(host.seq_lens):
                self.num_graph_misses += 1
                log = logger.info if self.num_graph_misses == 1 else logger.debug
                log("decode step of %d requests (page table width %d) missed the CUDA graphs",
                    len(host.seq_lens), host.page_table.shape[1])  # fmt: skip
        self.num_eager_steps += 1
        inputs = to_device(host, self.block_size, self.device, self.encoder_cache)
        self._fill_placeholders(inputs.input_ids, host)
        self.backend.begin_step(inputs.metadata)
        self._record_inputs_consumed()
        prepare_s = time.perf_counter() - start
        if launched is not None:
            launched.record()
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.backend, inputs.mm_rows, inputs.mm_embeds)
        prompt_logprobs = launch_prompt_logprobs(self.model, hidden, targets) if targets else None
        if not len(host.logits_rows):
            return None, prepare_s, prompt_logprobs
        return self.model.compute_logits(hidden[inputs.logits_rows]), prepare_s, prompt_logprobs

    def _record_inputs_consumed(self) -> None:
        if self.device.type == "cuda":
            self._inputs_consumed = torch.cuda.Event()
            self._inputs_consumed.record()

    def _wait_inputs_consumed(self) -> None:
        """Before reusing host staging memory: the previous step's asynchronous input copies (ours, and those the
        backend's ``begin_step`` enqueued from pinned buffers) must have run.  With a step in flight that is
        the only wait; it ends as soon as the device starts that step."""
        if self._inputs_consumed is not None:
            self._inputs_consumed.synchronize()
            self._inputs_consumed = None

    def _events(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        if not self.timing or self.device.type != "cuda":
            return None
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _encode(self, items: list[MultimodalInput]) -> None:
        """Run the vision tower on each new item; a failing item fails only the requests carrying it."""
        failed: dict[str, str] = {}
        for item in items:
            try:
                pixels = item.pixel_values.to(self.device, non_blocking=True)
                if pixels.is_floating_point():
                    pixels = pixels.to(self.dtype)
                grid = torch.tensor(item.grids, dtype=torch.int64, device=self.device)
                modality = "video" if item.modality is Modality.VIDEO else "image"
                embeds = self.model.encode_vision(pixels, grid, modality)
                self.encoder_cache.put(item.content_hash, embeds)
            except (RuntimeError, ValueError) as exc:
                logger.warning("vision encoder failed on %s: %s", item.content_hash, exc)
                failed[item.content_hash] = f"the vision encoder rejected an {item.modality.value}: {exc}"
        if failed:
            raise EncoderError(set(failed), "; ".join(sorted(set(failed.values()))))
