"""The media pipeline the chat route calls: fetch -> probe and plan -> limits -> decode and preprocess
(in the worker pool, into shared memory) -> items for the engine, with an LRU of processed items.

Usage from the API (one pipeline per server)::

    pipeline = MediaPipeline(load_profile(model_type, checkpoint), limits)
    await pipeline.start()
    items = await pipeline.process_media(parts, vision_token_budget=context_left)
    text = pipeline.expand_prompt(templated_text, items)       # before tokenizing, as the reference does
    ids = tokenizer.encode(text)
    spans = pipeline.placeholder_spans(ids, tokenizer, items)  # per item, into MultimodalItem.placeholders
    placed = pipeline.place(items, spans)  # what the prompt carries; gateway.engine_client.wire sends it
"""

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from . import image as image_codec
from . import video as video_codec
from .cache import CachedItem, ProcessedCache, content_key
from .errors import MediaError
from .fetch import MediaFetcher
from .limits import MediaLimits, check_vision_tokens
from .model_profile import ModelProfile, PixelPreprocessor, PlaceholderSpan, Tokenizer
from .plans import ImagePlan, Plan, VideoPlan, VideoProbe
from .pool import WorkerPool
from .transport import (
    Transport,
    WireDType,
    create_segment,
    map_segment,
    new_segment_name,
    read_segment,
    unlink_segment,
    write_segment,
)

logger = logging.getLogger(__name__)

Modality = Literal["image", "video"]


@dataclass(frozen=True)
class MediaPart:
    """One ``image_url`` / ``video_url`` content part, in prompt order."""

    modality: Modality
    url: str
    param: str | None = None  # e.g. "messages[0].content[1]", for error messages


@dataclass(frozen=True)
class ProcessedItem:
    modality: Modality
    plan: Plan
    num_tokens: int
    content_hash: str
    shape: tuple[int, ...]  # [num_patches, patch_dim]
    dtype: WireDType
    payload: bytes  # C order (layout: patchify.py)

    def patches(self) -> np.ndarray:
        """uint8 pixels, or bfloat16 bit patterns as uint16."""
        return np.frombuffer(self.payload, dtype=self.dtype.numpy).reshape(self.shape)


@dataclass(frozen=True)
class PlacedItem:
    """A processed item where one prompt puts it: the spans of its placeholder tokens, and how its patches travel
    to the engine (the pipeline's transport)."""

    item: ProcessedItem
    placeholders: tuple[PlaceholderSpan, ...]
    transport: Transport


@dataclass
class _Pending:
    part: MediaPart
    data: bytes
    key: str
    input_segment: str | None = None
    plan: Plan | None = None
    probe: VideoProbe | image_codec.ImageHeader | None = None  # what the decode needs from the probe
    item: ProcessedItem | None = None


class MediaPipeline:
    def __init__(
        self,
        profile: ModelProfile,
        limits: MediaLimits,
        *,
        transport: Transport | None = None,
        cache_bytes: int = 512 * 2**20,
        workers: int | None = None,
        pool: WorkerPool | None = None,
    ) -> None:
        """``pool``: a started pool to share (its owner closes it); by default the pipeline starts its own."""
        self.profile = profile
        self.limits = limits
        self.transport = transport or Transport()
        self.cache = ProcessedCache(cache_bytes)
        self._owns_pool = pool is None
        self.pool = pool or WorkerPool(workers, warmup=warm_worker)
        self.fetcher = MediaFetcher(limits)
        self._settings = f"{profile.model_type}/{profile.preprocessor.fingerprint()}/{self.transport.dtype}"

    async def start(self) -> None:
        if self._owns_pool:
            await self.pool.start()

    async def close(self) -> None:
        if self._owns_pool:
            await self.pool.close()
        await self.fetcher.close()

    async def process_media(
        self, parts: Sequence[MediaPart], vision_token_budget: int | None = None
    ) -> list[ProcessedItem]:
        """Every part fetched, checked and preprocessed, in order; the first bad part raises :class:`MediaError`."""
        self.limits.check_counts(sum(p.modality == "image" for p in parts), sum(p.modality == "video" for p in parts))
        pending: list[_Pending] = []
        try:
            fetched = await _all([self._fetch(part) for part in parts])
            pending = [_Pending(part, data, content_key(data, part.modality, self._settings)) for part, data in fetched]
            await _all([self._plan(p) for p in pending])
            check_vision_tokens(
                sum(self.profile.preprocessor.tokens_for(p.plan) for p in pending if p.plan), vision_token_budget
            )
            await _all([self._process(p) for p in pending if p.item is None])
        finally:
            for p in pending:
                if p.input_segment is not None:
                    unlink_segment(p.input_segment)
        return [p.item for p in pending if p.item is not None]

    def expand_prompt(self, text: str, items: Sequence[ProcessedItem]) -> str:
        prompt = self.profile.prompt
        images = [(i.plan, i.num_tokens) for i in items if isinstance(i.plan, ImagePlan)]
        videos = [(i.plan, i.num_tokens) for i in items if isinstance(i.plan, VideoPlan)]
        return prompt.expand_text(text, images, videos)

    def placeholder_spans(
        self, token_ids: Sequence[int], tokenizer: Tokenizer, items: Sequence[ProcessedItem]
    ) -> list[list[PlaceholderSpan]]:
        """Spans per item; ``items`` are in prompt order (the order of the content parts)."""
        return self.profile.prompt.placeholder_spans(
            token_ids, tokenizer, [i.modality for i in items], [i.num_tokens for i in items]
        )

    def place(
        self, items: Sequence[ProcessedItem], spans: Sequence[Sequence[PlaceholderSpan]]
    ) -> tuple[PlacedItem, ...]:
        """The items with their spans (``placeholder_spans``), as the prompt carries them to the engine."""
        return tuple(
            PlacedItem(item, tuple(item_spans), self.transport) for item, item_spans in zip(items, spans, strict=True)
        )

    async def _fetch(self, part: MediaPart) -> tuple[MediaPart, bytes]:
        cap = self.limits.max_image_bytes if part.modality == "image" else self.limits.max_video_bytes
        try:
            return part, await self.fetcher.fetch(part.url, cap)
        except MediaError as exc:
            exc.at(part.param)
            raise

    async def _plan(self, p: _Pending) -> None:
        cached = self.cache.get(p.key)
        if cached is not None:
            p.plan = cached.plan
            p.item = self._item(p, cached.plan, cached.shape, cached.payload)
            return
        p.input_segment = new_segment_name()
        try:
            await asyncio.to_thread(write_segment, p.input_segment, p.data)
        except OSError as exc:
            raise MediaError(
                f"the gateway's shared memory cannot hold this media ({exc.strerror}); retry later or send less",
                "media_capacity",
                status=503,
            ) from None
        job = probe_image_job if p.part.modality == "image" else probe_video_job
        try:
            p.plan, p.probe = await self.pool.run(
                job, p.input_segment, self.profile.preprocessor, self.limits, timeout_s=self.limits.job_timeout_s
            )
        except MediaError as exc:
            exc.at(p.part.param)
            raise

    async def _process(self, p: _Pending) -> None:
        assert p.plan is not None and p.input_segment is not None
        shape = (p.plan.num_patches, p.plan.patch_dim)
        output = new_segment_name()
        try:
            await self.pool.run(
                process_job, p.input_segment, self.profile.preprocessor, p.plan, p.probe, output, shape,
                self.transport.dtype, self.limits, timeout_s=self.limits.job_timeout_s,
            )  # fmt: skip
            payload = await asyncio.to_thread(read_segment, output)
        except MediaError as exc:
            exc.at(p.part.param)
            raise
        finally:
            unlink_segment(output)
        self.cache.put(p.key, CachedItem(p.plan, shape, payload))
        p.item = self._item(p, p.plan, shape, payload)

    def _item(self, p: _Pending, plan: Plan, shape: tuple[int, ...], payload: bytes) -> ProcessedItem:
        tokens = self.profile.preprocessor.tokens_for(plan)
        return ProcessedItem(p.part.modality, plan, tokens, p.key, shape, self.transport.dtype, payload)


async def _all(coroutines: list) -> list:
    """Run concurrently to the end (a failed item does not cut its siblings' jobs short, which would cost
    their workers), then raise the first failure in item order."""
    results = await asyncio.gather(*coroutines, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


# ---------------------------------------------------------------------------------------------
# Jobs: run inside pool workers (module-level so they pickle by reference).


def warm_worker() -> None:
    """Import the heavy modules once per worker, not on its first job."""
    from .resize import ResizeBackend, resolve_backend

    resolve_backend(ResizeBackend.AUTO)


def probe_image_job(
    segment: str, preprocessor: PixelPreprocessor, limits: MediaLimits
) -> tuple[ImagePlan, image_codec.ImageHeader]:
    header = image_codec.probe_image(read_segment(segment), limits.image_formats)
    limits.check_image_pixels(header.width, header.height)
    return preprocessor.plan_image(header.height, header.width), header


def probe_video_job(segment: str, preprocessor: PixelPreprocessor, limits: MediaLimits) -> tuple[VideoPlan, VideoProbe]:
    probe = video_codec.probe_video(
        read_segment(segment),
        limits.max_video_frame_pixels,
        limits.max_video_frames,
        limits.video_containers,
        limits.video_codecs,
    )
    limits.check_video_duration(probe.frame_count, probe.fps, probe.duration_s)
    plan = preprocessor.plan_video(probe)
    walk = video_codec.frames_to_decode(probe, video_codec.plan_decode(probe, plan.frame_indices))
    limits.check_video_plan(len(plan.frame_indices), plan.source_width, plan.source_height, walk)
    return plan, probe


def process_job(
    segment: str,
    preprocessor: PixelPreprocessor,
    plan: Plan,
    probe: VideoProbe | image_codec.ImageHeader | None,
    output: str,
    shape: tuple[int, int],
    dtype: WireDType,
    limits: MediaLimits,
) -> None:
    """Decode and preprocess one item into the new segment ``output``, sized from the plan."""
    data = read_segment(segment)
    create_segment(output, int(np.prod(shape)) * dtype.numpy.itemsize)
    target = map_segment(output, dtype.numpy, shape)
    patches = target if dtype is WireDType.UINT8 else np.empty(shape, dtype=np.uint8)
    if isinstance(plan, ImagePlan):
        header = probe if isinstance(probe, image_codec.ImageHeader) else None
        rgb = image_codec.decode_image(data, limits.image_formats, header)
        if rgb.shape[:2] != (plan.source_height, plan.source_width):
            raise MediaError("the image's decoded size differs from its header")
        preprocessor.run_image(rgb, plan, patches)
    else:
        assert isinstance(probe, VideoProbe)
        frames = video_codec.iter_frames(
            data, probe, plan.frame_indices, limits.decode_threads, limits.video_containers
        )
        preprocessor.run_video(frames, plan, patches)
    if dtype is WireDType.BFLOAT16:
        preprocessor.normalize_bfloat16(patches, out=target)
