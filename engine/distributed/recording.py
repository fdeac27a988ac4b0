"""Rank 0's attention backend in a parallel engine: it records what the workers need of each step."""

import numpy as np

from m3stack.engine.attention.backend import AttentionBackend, DelegatingBackend
from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.offload.device import DeviceOffload, OffloadStep


class RecordingBackend(DelegatingBackend):
    """Rank 0's attention backend, remembering what the workers need of the step being planned: its metadata, and
    with CPU KV offload the offload decisions the runner applied just before (``DeviceOffload.last_step``)."""

    def __init__(self, inner: AttentionBackend) -> None:
        super().__init__(inner)
        self.metadata: AttentionMetadata | None = None
        self.offload: DeviceOffload | None = getattr(inner, "offload", None)
        self.offload_step: OffloadStep | None = None

    def begin_step(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        if self.offload is not None:
            self.offload_step, self.offload.last_step = self.offload.last_step, None
        self.inner.begin_step(metadata)

    def take_offload_ints(self) -> np.ndarray:
        """The recorded offload step as integers, once (empty without offload)."""
        if self.offload is None:
            return np.zeros(0, dtype=np.int64)
        if self.offload_step is None:
            raise RuntimeError("a step with CPU KV offload was planned without its offload decisions")
        step, self.offload_step = self.offload_step, None
        return step.to_ints()
