"""The step loop's body: schedule, launch, finish, apply; request-level failures never stop the engine.

``EngineCore`` is single-threaded (the server drives it from one thread).  With async scheduling
(the default on GPUs) one step stays in flight: each ``step()`` schedules and launches step N+1,
then waits for step N and applies it, so the host's scheduling and bookkeeping overlap the GPU's
work instead of leaving it idle.  Without it, each ``step()`` runs one step to completion.

A step that fails ends only the requests it touched: an image the vision tower rejects ends the
requests that carry it with INVALID_ARGUMENT while the others are rewound and run next step; any
other failure ends that step's requests with INTERNAL and is logged with its traceback.
"""

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from m3stack.engine.msa.metrics import MsaStats
from m3stack.engine.offload.metrics import OffloadStats
from m3stack.engine.runtime.errors import DuplicateRequestError, EngineError, InvalidRequestError
from m3stack.engine.runtime.grammar import GrammarCompiler
from m3stack.engine.runtime.model_info import ModelInfo
from m3stack.engine.runtime.request import Request, RequestOutput, SampledToken
from m3stack.engine.runtime.scheduler import Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from m3stack.engine.msa.metrics import MsaMonitor
    from m3stack.engine.offload.device import DeviceOffload

logger = logging.getLogger(__name__)


class Runner(Protocol):
    def launch(self, out: SchedulerOutput) -> Any:
        """Run the encoder items and enqueue the forward and sampling of ``out``; returns a handle at once."""
        ...

    def sample(self, launched: Any) -> None:
        """Launch a step's sampling if ``launch`` left it for later (its grammar masks need every earlier step's
        tokens applied: the core calls this once they are)."""
        ...

    def finish(self, launched: Any) -> dict[str, SampledToken]:
        """Wait for a launched step: the sampled token of every request that samples."""
        ...


class EncoderError(Exception):
    """The vision tower could not encode some items (by content hash); nothing else of the step ran."""

    def __init__(self, content_hashes: set[str], message: str) -> None:
        super().__init__(message)
        self.content_hashes = content_hashes
        self.message = message


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_used_tokens: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    encoder_cache_hits: int
    encoder_cache_misses: int
    num_steps: int
    offload: OffloadStats | None = None  # CPU KV offload's counters, when it is on
    msa: MsaStats | None = None  # MSA's selected blocks and index scan times, when the engine runs MSA layers

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(frozen=True)
class StepReport:
    """What one step did, for metrics and benchmarks."""

    outputs: list[RequestOutput]
    num_requests: int
    num_tokens: int
    is_pure_decode: bool
    seconds: float
    schedule_s: float = 0.0
    execute_s: float = 0.0  # launching this step (input preparation, the forward's and sampling's launch)
    wait_s: float = 0.0  # waiting for the completed step's tokens (the device's share once async hides the host)
    update_s: float = 0.0  # applying them (scheduler bookkeeping)


class EngineCore:
    def __init__(
        self,
        info: ModelInfo,
        scheduler: Scheduler,
        runner: Runner,
        *,
        async_scheduling: bool = False,
        offload: "DeviceOffload | None" = None,
        msa: "MsaMonitor | None" = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.info = info
        self.scheduler = scheduler
        self.runner = runner
        self.async_scheduling = async_scheduling
        self.offload = offload
        self.msa = msa
        self.num_steps = 0
        self._in_flight: tuple[SchedulerOutput, Any] | None = None
        self.grammars = grammars

    def grammar_compiler(self) -> GrammarCompiler:
        if self.grammars is None:
            raise InvalidRequestError("this engine has no grammar compiler (the model folder has no tokenizer.json)")
        return self.grammars

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def add_request(self, request: Request, *, bypass_queue_limit: bool = False) -> None:
        if request.request_id in self.scheduler.requests:
            raise DuplicateRequestError(f"request_id {request.request_id!r} is already running")
        if request.sampling.grammar is not None:
            if request.grammar is None:  # not compiled on arrival (the server does that off this thread): now
                request.grammar = self.grammar_compiler().submit(request.sampling.grammar)
            request.grammar.matcher  # noqa: B018 - waits for the compilation; raises InvalidRequestError if it failed
        cache = self.scheduler.encoder_cache
        for item in request.mm_inputs:
            if not cache.fits(item.num_embeds):
                raise InvalidRequestError(
                    f"an {item.modality.value} of {item.num_embeds} embeddings exceeds the encoder cache "
                    f"({cache.capacity_embeds}); send it smaller or raise the engine's encoder cache size"
                )
        self.scheduler.add_request(request, bypass_queue_limit=bypass_queue_limit)

    def abort_request(self, request_id: str, message: str) -> RequestOutput | None:
        return self.scheduler.abort_request(request_id, message)

    def step(self) -> StepReport:
        """Advance by one step; the report describes the step that completed (the previous one when async)."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        scheduled = time.perf_counter()
        outputs: list[RequestOutput] = []
        launched = self._launch(out, outputs) if not out.is_empty else None
        if self.async_scheduling:
            completed, self._in_flight = self._in_flight, launched
        else:
            completed = launched if self._sample(launched, outputs) else None
        executed = time.perf_counter()
        waited = 0.0
        if completed is not None:
            finished, waited = self._finish(*completed)
            outputs += finished
        if self.async_scheduling and not self._sample(launched, outputs):
            self._in_flight = None
        end = time.perf_counter()
        done = completed[0] if completed is not None else SchedulerOutput()
        return StepReport(
            outputs,
            len(done.requests),
            done.num_tokens,
            bool(done.requests) and all(s.num_new_tokens == 1 and s.samples for s in done.requests),
            end - start,
            schedule_s=scheduled - start,
            execute_s=executed - scheduled,
            wait_s=waited,
            update_s=end - executed - waited,
        )

    def _launch(self, out: SchedulerOutput, outputs: list[RequestOutput]) -> tuple[SchedulerOutput, Any] | None:
        self.num_steps += 1
        try:
            return out, self.runner.launch(out)
        except EncoderError as failure:
            logger.warning("vision encoder rejected items: %s", failure.message)
            failed = {
                s.request.request_id
                for s in out.requests
                if any(m.content_hash in failure.content_hashes for m in s.request.mm_inputs)
            }
            outputs += self._fail(sorted(failed), InvalidRequestError(failure.message))
            self.scheduler.rewind(out, {s.request.request_id for s in out.requests} - failed)
        except Exception as exc:
            outputs += self._fail_step(out, exc)
        return None

    def _sample(self, launched: tuple[SchedulerOutput, Any] | None, outputs: list[RequestOutput]) -> bool:
        """The runner's deferred sampling of a launched step (grammar masks, built from the matchers as they are now);
        False when it failed, and the step's requests were ended."""
        if launched is None:
            return True
        try:
            self.runner.sample(launched[1])
        except Exception as exc:
            outputs += self._fail_step(launched[0], exc)
            return False
        return True

    def _finish(self, out: SchedulerOutput, launched: Any) -> tuple[list[RequestOutput], float]:
        """The step's outputs, and the seconds spent waiting for its tokens."""
        start = time.perf_counter()
        try:
            sampled = self.runner.finish(launched)
        except Exception as exc:
            return self._fail_step(out, exc), time.perf_counter() - start
        waited = time.perf_counter() - start
        return self.scheduler.update(out, sampled), waited

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        logger.error("step failed; ending its %d requests", len(out.requests), exc_info=exc)
        error = EngineError(f"the engine step failed: {type(exc).__name__}: {exc}")
        return self._fail([s.request.request_id for s in out.requests], error)

    def _fail(self, request_ids: list[str], error: EngineError) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            output = self.scheduler.abort_request(request_id, error.message)
            if output is not None:
                output.error = error
                outputs.append(output)
        return outputs

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        encoder = self.scheduler.encoder_cache
        used_blocks = kv.pool.num_usable_blocks - kv.pool.num_free_blocks  # device blocks
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=kv.usage,
            num_used_tokens=used_blocks * kv.block_size,
            prefix_query_tokens=kv.prefix_query_tokens,
            prefix_hit_tokens=kv.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            encoder_cache_hits=encoder.hits,
            encoder_cache_misses=encoder.misses,
            num_steps=self.num_steps,
            offload=self.offload.stats() if self.offload is not None else None,
            msa=self.msa.stats() if self.msa is not None else None,
        )
