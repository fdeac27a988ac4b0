"""How the GPU backend runs an MSA decode layer: the choices bench/msa_decode.py sweeps on the H200.

The defaults are the expected fastest (reasoning below; the benchmark's ``decode_sweep`` and
``tuned`` rows show whether a run agrees):

* the index scan with its merge in the last program of each request (one launch; the merge ranks
  one head per split, then only the lists those heads lead).  The merge as a launch of one-warp programs
  (``ScanConfig(fused_merge=False, merge_warps=1)``) is faster at batch 1 and slower at batch 8 (H200,
  2026-12-01: 1M x 1 index 72.9 against 77.3 us, 128K x 1 20.0 against 22.7, 128K x 8 82.6 against 74.7),
  and made the default it broke the GPU suite's tiny-model engine tests (lists of 4 slots, see
  ``decode_index._FEW_WARP_MERGE_MIN_SLOTS``, now always merged by 4 warps).  So a decode batch of one
  request (a single long conversation, where the layer's latency is the step's) merges in its own one-warp
  launch (``single_request_merge_warps``) and larger batches keep the fused merge;
* three scan programs per SM (their shared memory allows three; one wave, no tail), an fp8 k-index's scan
  at 2 stages (its registers allow three programs per SM only there);
* the Triton split-K attention with the splits combined in each row's last program: one launch and no
  host-side plan, where FlashInfer's flattened decode takes a split-K launch, a merge launch and a
  host plan per step for 16 pages a row (latency, not bandwidth, is that kernel's cost);
* the scan storing the step's new keys in pure-decode steps (saves the store's own launch).
"""

from dataclasses import dataclass, field, replace
from typing import Literal

from m3stack.engine.msa.decode_attention import TritonDecodeConfig
from m3stack.engine.msa.decode_index import ScanConfig
from m3stack.engine.msa.decode_plan import SCAN_PROGRAMS_PER_SM

DecodeAttentionKernel = Literal["triton", "flashinfer"]


@dataclass(frozen=True)
class DecodeTuning:
    scan: ScanConfig = field(default_factory=ScanConfig)
    # The scan over an fp8 k-index: its keys are widened to fp16 in registers.  Chosen when they went on to bf16
    # (3 stages took 220 registers a thread on the H200: 2 programs per SM, so 3 per SM ran in two waves; 2 stages
    # 158, 3 per SM).  Since the scan multiplies them in fp16 against bf16 queries, Triton 3.6 compiles 2 and 3
    # stages alike at 163-164 registers, 3 per SM (bench.sm90_compile --kernels scan); not re-timed yet.
    fp8_scan: ScanConfig = field(default_factory=lambda: ScanConfig(num_stages=2))
    scan_programs_per_sm: int = SCAN_PROGRAMS_PER_SM
    # Warps of the merge's own launch when a decode batch has one request; None: as ``scan`` / ``fp8_scan`` say.
    single_request_merge_warps: int | None = 1
    # "flashinfer" where FlashInfer serves the cache (CUDA, fp16/bf16), else the Triton kernel.
    attention: DecodeAttentionKernel = "triton"
    triton_attention: TritonDecodeConfig = field(default_factory=TritonDecodeConfig)
    # The scan stores each pure-decode step's new K, V and index key (no store launch).
    fused_store: bool = True
    # Decode batches of at least this many requests have the Triton attention merge the scan's lists itself
    # (``msa.decode_fused``): one launch after the scan instead of a merge and an attention; None: never.  On the
    # H200 (2026-12-04, bench/msa_decode.py, M3 dims, layer us with it / with the merge's own launch): batch 8 at
    # 128K / 512K / 1M 86.9 / 89.4, 262 / 266, 495 / 498 (fp8 k-index 75 / 81, 212 / 228, 395 / 425); batch 1
    # 29.2 / 28.5, 52.8 / 52.9, 82.6 / 81.7, where the one-warp merge launch (``single_request_merge_warps``)
    # is as fast.  Where FlashInfer attends or CPU offload resolves pages in between, the merge keeps its launch.
    select_in_attention_min_requests: int | None = 2

    def __post_init__(self) -> None:
        if self.attention not in ("triton", "flashinfer"):
            raise ValueError(f"attention must be 'triton' or 'flashinfer', not {self.attention!r}")
        if self.scan_programs_per_sm < 1:
            raise ValueError(f"scan_programs_per_sm must be >= 1, got {self.scan_programs_per_sm}")
        if self.single_request_merge_warps is not None:
            ScanConfig(fused_merge=False, merge_warps=self.single_request_merge_warps)  # validates the count

    @property
    def planned_programs_per_sm(self) -> int:
        """Scan programs per SM a step's plan is sized for.  A shared-page scan's program serves up to
        ``shared_group`` requests where their pages are shared (the others of the group only store), so the plan
        splits each request that much finer to keep the programs that do scan filling the GPU."""
        return self.scan_programs_per_sm * (self.scan.shared_group if self.scan.shared_pages else 1)

    def selects_in_attention(self, num_requests: int) -> bool:
        """Whether a decode batch of ``num_requests`` leaves the merge to the attention (``msa.decode_fused``)."""
        least = self.select_in_attention_min_requests
        return least is not None and num_requests >= least

    def scan_for(self, num_requests: int, fp8_index: bool, unmerged: bool = False) -> ScanConfig:
        """The scan of a decode batch of ``num_requests`` over a bf16 or fp8 k-index; ``unmerged``: its lists are
        left for the attention to merge."""
        scan = self.fp8_scan if fp8_index else self.scan
        if unmerged:
            return replace(scan, fused_merge=False)
        if num_requests == 1 and self.single_request_merge_warps is not None:
            return replace(scan, fused_merge=False, merge_warps=self.single_request_merge_warps)
        return scan
