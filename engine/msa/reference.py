"""MSA in plain PyTorch, float32: the oracle every MSA kernel is tested against.

Semantics are those of ``transformers``' ``MiniMaxM3VLIndexer`` plus its block mask (docs/msa.md#semantics),
for ONE request whose keys sit at positions ``0 .. S-1`` (gather a paged cache first).  Query token
``t`` sits at ``q_positions[t]`` and sees keys ``j <= q_positions[t]``.

Selection layout, shared with the kernels: ``[Hidx, T, topk]`` int64 logical block ids, head-major.
Each row holds the ranked historical blocks (best score first, ties to the lower block id), then the
local blocks in ascending order (so the block holding the query itself is the LAST valid entry, as
the paged decode kernels need), then ``-1`` padding.  A token at block ``q`` has
``min(topk, q + 1)`` valid entries.  HF returns only ``min(topk, num_key_blocks)`` columns and sorts
the local block first; as sets the selections are equal.
"""

import torch

# Rows of the ``[T, S]`` score matrix computed at once, so long references stay within memory.
_QUERY_CHUNK = 512


def _check_positions(q_positions: torch.Tensor, num_tokens: int, num_keys: int) -> None:
    if q_positions.shape != (num_tokens,):
        raise ValueError(f"q_positions has shape {tuple(q_positions.shape)}, expected ({num_tokens},)")
    if num_tokens and (int(q_positions.min()) < 0 or int(q_positions.max()) >= num_keys):
        raise ValueError(f"q_positions must lie in [0, {num_keys}); got {q_positions.tolist()}")


def block_scores(
    index_q: torch.Tensor, index_k: torch.Tensor, q_positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Max over each block's visible keys of ``<index_q[t, h], index_k[j]>``: ``[Hidx, T, num_blocks]`` fp32.

    Keys after the query are ``-inf`` before the max, so blocks wholly in the future score ``-inf``.
    """
    num_tokens, num_heads, _ = index_q.shape
    num_keys = index_k.shape[0]
    _check_positions(q_positions, num_tokens, num_keys)
    num_blocks = -(-num_keys // block_size)
    padded = num_blocks * block_size
    key_pos = torch.arange(padded, device=index_k.device)
    keys = index_k.float()
    out = torch.empty((num_heads, num_tokens, num_blocks), dtype=torch.float32, device=index_q.device)
    for start in range(0, num_tokens, _QUERY_CHUNK):
        stop = min(start + _QUERY_CHUNK, num_tokens)
        scores = torch.einsum("thd,sd->hts", index_q[start:stop].float(), keys)
        scores = torch.nn.functional.pad(scores, (0, padded - num_keys), value=float("-inf"))
        future = key_pos[None, None, :] > q_positions[None, start:stop, None]
        scores = scores.masked_fill(future, float("-inf"))
        out[:, start:stop] = scores.view(num_heads, stop - start, num_blocks, block_size).amax(-1)
    return out


def index_block_topk(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    q_positions: torch.Tensor,
    block_size: int,
    topk: int,
    local_blocks: int,
) -> torch.Tensor:
    """MSA block selection for one request: ``[Hidx, T, topk]`` int64 (layout in the module docstring).

    ``index_q`` ``[T, Hidx, d]`` and ``index_k`` ``[S, d]`` are the indexer's query and (shared) key
    after norm and RoPE.  The ``local_blocks`` blocks ending at the query's own block are always
    kept; the remaining ``topk - local`` slots go to the best-scoring earlier blocks.
    """
    if not 1 <= local_blocks <= topk:
        raise ValueError(f"need 1 <= local_blocks <= topk, got local_blocks={local_blocks}, topk={topk}")
    scores = block_scores(index_q, index_k, q_positions, block_size)
    num_heads, num_tokens, num_blocks = scores.shape
    device = scores.device
    q_block = (q_positions // block_size).to(device)  # [T]
    num_local = torch.clamp(q_block + 1, max=local_blocks)  # [T]
    first_local = q_block - num_local + 1  # [T]; blocks below it are ranked candidates
    block_ids = torch.arange(num_blocks, device=device)
    candidate = block_ids[None, :] < first_local[:, None]  # [T, NB]
    ranked_scores = scores.masked_fill(~candidate[None], float("-inf"))
    # A stable descending sort keeps equal scores in block-id order: ties go to the lower id.
    order = torch.sort(ranked_scores, dim=-1, descending=True, stable=True).indices
    num_ranked = torch.minimum(topk - num_local, first_local)  # [T], same for every head
    slot = torch.arange(topk, device=device)
    ranked_part = slot[None, :] < num_ranked[:, None]  # [T, topk]
    local_part = (slot[None, :] >= num_ranked[:, None]) & (slot[None, :] < (num_ranked + num_local)[:, None])
    local_ids = first_local[:, None] + slot[None, :] - num_ranked[:, None]  # [T, topk]
    width = min(topk, num_blocks)
    ranked_ids = torch.full((num_heads, num_tokens, topk), -1, dtype=torch.int64, device=device)
    ranked_ids[..., :width] = order[..., :width]
    selected = torch.where(ranked_part[None], ranked_ids, torch.full_like(ranked_ids, -1))
    return torch.where(local_part[None], local_ids[None].expand_as(selected), selected)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention with a per-(KV head, token, key) mask ``allowed`` ``[Hkv, T, S]``; fp32 out."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.float().view(num_tokens, num_kv_heads, group, head_dim)
    scores = torch.einsum("thgd,shd->hgts", qg, k.float()) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgts,shd->thgd", probs, v.float())
    return out.reshape(num_tokens, num_q_heads, head_dim)


def _check_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if k.shape != v.shape or k.dim() != 3 or q.dim() != 3 or q.shape[2] != k.shape[2]:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal GQA (the ``full_attention`` layers): q ``[T, Hq, D]``, k/v ``[S, Hkv, D]`` -> ``[T, Hq, D]`` fp32."""
    _check_gqa(q, k, v)
    _check_positions(q_positions, q.shape[0], k.shape[0])
    key_pos = torch.arange(k.shape[0], device=k.device)
    allowed = key_pos[None, :] <= q_positions[:, None]
    return _attention(q, k, v, allowed[None].expand(k.shape[1], -1, -1), scale)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    selected: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Block-sparse GQA: query head ``i`` attends the keys ``j <= q_positions[t]`` of the blocks in
    ``selected[i // G, t]`` (``-1`` entries ignored, order irrelevant).  Returns ``[T, Hq, D]`` fp32."""
    _check_gqa(q, k, v)
    num_tokens, num_keys, num_kv_heads = q.shape[0], k.shape[0], k.shape[1]
    _check_positions(q_positions, num_tokens, num_keys)
    if selected.shape[:2] != (num_kv_heads, num_tokens):
        raise ValueError(f"selected has shape {tuple(selected.shape)}, expected ({num_kv_heads}, {num_tokens}, K)")
    num_blocks = -(-num_keys // block_size)
    # Scatter the kept blocks into a [Hkv, T, NB + 1] map; -1 lands in a spare column that is dropped.
    safe = selected.long().masked_fill(selected < 0, num_blocks)
    keep = torch.zeros((num_kv_heads, num_tokens, num_blocks + 1), dtype=torch.bool, device=q.device)
    keep.scatter_(-1, safe, True)
    key_pos = torch.arange(num_keys, device=k.device)
    allowed = keep[..., key_pos // block_size] & (key_pos[None, None, :] <= q_positions[None, :, None])
    return _attention(q, k, v, allowed, scale)


def selection_overlap(selected: torch.Tensor, other: torch.Tensor) -> tuple[int, int]:
    """(blocks of ``selected`` that ``other`` selects too, blocks ``selected`` holds) over all rows of two selections
    ``[..., topk]`` (``-1`` entries ignored, order irrelevant): how far two k-index formats agree."""
    if selected.shape != other.shape:
        raise ValueError(f"selections of shapes {tuple(selected.shape)} and {tuple(other.shape)}")
    valid = selected >= 0
    shared = (selected[..., :, None] == other[..., None, :]).any(-1) & valid
    return int(shared.sum()), int(valid.sum())
