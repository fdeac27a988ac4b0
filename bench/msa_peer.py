"""The peer for the MSA benchmarks: the reference stack's M3 Triton MSA kernels, timed in the same process as ours.

``../shared/peer/rebuild.sh`` (run from the repository root) extracts vLLM's MiniMax-M3 Hopper kernels (index
top-k, sparse prefill, split-K paged decode) from its pinned PyPI wheel into ``.peer/vllm_m3/``, which git
ignores (``.git/info/exclude``) and a GPU call carries.  Their source never enters this repository: this module
imports them from there and calls them with the arguments vLLM's Hopper indexer and sparse-attention classes pass
(the call sites ``../shared/peer/bench_vllm_m3.py`` documents), over the same inputs as our kernels.  Programmatic
dependent launch is on, as vLLM has it on every SM90+ GPU (``VLLM_M3_PDL=1`` for the shim, unless set otherwise).

Layouts differ from ours in one place: the peer's KV cache interleaves K and V per page and head
(``[pages, Hkv, B, 2D]``), so the benchmarks build it from our K and V caches; the index-key cache
(``[pages, B, d]``), the page table, the lengths and the queries are ours, shared.
"""

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("bench.msa_peer")

ROOT = Path(__file__).resolve().parent.parent
# Rows of vLLM's top-k buffer (``max_num_batched_tokens``), as the peer's harness allocates it.
_TOPK_BUFFER_ROWS = 8192


@dataclass(frozen=True)
class Peer:
    index_topk: ModuleType
    sparse_attn: ModuleType
    source: dict[str, str]  # .peer/SOURCE: the wheel, its commit and the files' hashes
    pdl: bool

    def describe(self) -> dict[str, object]:
        return {"source": self.source, "pdl": self.pdl, "kernels": "vllm/models/minimax_m3/common/ops"}


def peer_dir() -> Path:
    return Path(os.environ.get("PEER_DIR", ROOT / ".peer"))


def load_peer() -> Peer | None:
    """The rebuilt peer kernels, or None (logged) where ``.peer`` is absent or does not import."""
    folder = peer_dir()
    if not (folder / "vllm_m3" / "index_topk.py").exists():
        logger.warning(
            "%s/vllm_m3 missing (run `bash ../shared/peer/rebuild.sh` and carry .peer): no peer rows", folder
        )
        return None
    os.environ.setdefault("VLLM_M3_PDL", "1")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        from vllm_m3 import _vllm_shim, index_topk, sparse_attn
    except Exception:
        logger.exception("the peer kernels in %s do not import", folder)
        return None
    source = {}
    for line in (folder / "SOURCE").read_text().splitlines() if (folder / "SOURCE").exists() else []:
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            source[key] = f"{source[key]} {value}" if key in source else value
    return Peer(index_topk, sparse_attn, source, _vllm_shim.current_platform.is_arch_support_pdl())


def reset_autotune(peer: Peer) -> None:
    """Forget the peer's autotuned launch configs, so each shape is tuned at its own size (its best case; vLLM
    itself tunes once, at whatever call comes first)."""
    import triton

    for module in (peer.index_topk, peer.sparse_attn):
        for value in vars(module).values():
            kernel = value
            while kernel is not None and not isinstance(kernel, triton.runtime.Autotuner):
                kernel = getattr(kernel, "fn", None)
            if kernel is not None:
                kernel.cache.clear()


def interleaved_kv(key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
    """The peer's KV cache ``[pages, Hkv, B, 2D]`` (K | V) holding our HND K and V caches' contents."""
    return torch.cat([key_cache, value_cache], dim=-1)


def topk_buffer(num_tokens: int, index_heads: int, topk: int, device: torch.device) -> torch.Tensor:
    """vLLM's token-major top-k buffer ``[rows, Hidx, topk]`` int32 (its kernels write it head-major, transposed)."""
    rows = -(-max(num_tokens, _TOPK_BUFFER_ROWS) // 4) * 4
    return torch.empty(rows, index_heads, topk, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class PeerDims:
    num_kv_heads: int
    topk: int
    local_blocks: int
    scale: float
    init_blocks: int = 0  # M3 forces no initial (sink) blocks


def decode_layer(peer: Peer, dims: PeerDims, index_q: torch.Tensor, index_key_cache: torch.Tensor,
                 q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                 max_seq_len: int, buffer: torch.Tensor, out: torch.Tensor) -> None:  # fmt: skip
    """One decode layer as vLLM's Hopper path runs it (one new token per request): the index decode writes the
    selection into the shared top-k buffer, the split-K sparse decode attends it."""
    tokens = q.shape[0]
    peer.index_topk.minimax_m3_index_decode(
        index_q, index_key_cache, page_table, seq_lens, max_seq_len, dims.topk, dims.init_blocks, dims.local_blocks,
        dims.num_kv_heads, 1, 1, out=buffer.transpose(0, 1),
    )  # fmt: skip
    selection = buffer[:tokens].transpose(0, 1)
    peer.sparse_attn.minimax_m3_sparse_attn_decode(
        q, kv_cache, selection[:, :tokens, :], page_table, seq_lens, dims.num_kv_heads, dims.scale, out, 1
    )


def prefill_layer(peer: Peer, dims: PeerDims, index_q: torch.Tensor, index_key_cache: torch.Tensor,
                  q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, buffer: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One request prefilling ``len(q)`` tokens from scratch in one chunk, as vLLM's Hopper path runs it: index
    scores, top-k into the buffer, block-sparse attention.  Returns the selection ``[Hidx, T, topk]``."""
    tokens = q.shape[0]
    device = q.device
    query_start = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    context_lens = torch.zeros(1, dtype=torch.int32, device=device)
    score = peer.index_topk.minimax_m3_index_score(
        index_q, index_key_cache, page_table, query_start, seq_lens, context_lens, tokens, tokens, dims.num_kv_heads
    )
    peer.index_topk.minimax_m3_index_topk(
        score, query_start, context_lens, tokens, dims.topk, dims.init_blocks, dims.local_blocks,
        out=buffer.transpose(0, 1),
    )  # fmt: skip
    del score
    selection = buffer[:tokens].transpose(0, 1)
    peer.sparse_attn.minimax_m3_sparse_attn(
        q, kv_cache, selection, page_table, query_start, seq_lens, context_lens, tokens, dims.num_kv_heads,
        dims.scale, out,
    )  # fmt: skip
    return selection
