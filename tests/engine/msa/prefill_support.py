"""Shared by the MSA prefill tests (CPU and GPU) and benchmark: a paged batch builder (requests with
a cached prefix and a chunk of new tokens, keys scattered over a shuffled page pool, unused slots
poisoned) and a tie-tolerant comparison of block selections."""

from dataclasses import dataclass, replace

import torch

from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import (
    FP8_KV_DTYPE,
    dequantize_index_keys,
    fp8_index_from,
    quantize_index_keys,
    to_kv_cache,
)


@dataclass
class PagedBatch:
    metadata: AttentionMetadata
    key_cache: torch.Tensor  # [num_pages, Hkv, B, D]
    value_cache: torch.Tensor  # [num_pages, Hkv, B, D]
    index_key_cache: torch.Tensor  # [num_pages, B, d]
    keys: list[torch.Tensor]  # per request, contiguous [S, Hkv, D]
    values: list[torch.Tensor]  # per request, contiguous [S, Hkv, D]
    index_keys: list[torch.Tensor]  # per request, contiguous [S, d]
    token_ranges: list[tuple[int, int]]  # per request, its rows of the flat [T, ...] tensors

    index_key_scale: torch.Tensor | None = None  # [num_pages, B] float32 with an fp8 k-index (``with_fp8_index``)

    def request_positions(self, request: int) -> torch.Tensor:
        start, stop = self.token_ranges[request]
        return self.metadata.positions[start:stop]


def with_fp8_kv(batch: PagedBatch) -> PagedBatch:
    """The batch with an fp8 KV cache (e4m3, clamped, scale 1); its per-request K and V become what the kernels read,
    the stored values widened.  Unwritten slots stay NaN."""
    key_cache, value_cache = (to_kv_cache(c, FP8_KV_DTYPE) for c in (batch.key_cache, batch.value_cache))
    keys, values = ([to_kv_cache(x, FP8_KV_DTYPE).float() for x in xs] for xs in (batch.keys, batch.values))
    return replace(batch, key_cache=key_cache, value_cache=value_cache, keys=keys, values=values)


def with_fp8_index(batch: PagedBatch) -> PagedBatch:
    """The batch with its k-index stored as the engine stores an fp8 one: e4m3 keys divided by a float32 scale per
    token, in raw pages holding both (``kv_cache.tensors``); its per-request index keys become what the kernels
    score, the dequantized keys.  Unwritten slots stay NaN."""
    keys, scales = fp8_index_from(batch.index_key_cache)
    scales.masked_fill_(batch.index_key_cache.isnan().any(-1), float("nan"))
    index_keys = [dequantize_index_keys(*quantize_index_keys(k)) for k in batch.index_keys]
    return replace(batch, index_key_cache=keys, index_key_scale=scales, index_keys=index_keys)


def _scatter(cache: torch.Tensor, pages: torch.Tensor, values: torch.Tensor, block_size: int) -> None:
    """Write contiguous per-token ``values`` ``[S, ...]`` into ``cache`` pages (HND when 4-D)."""
    positions = torch.arange(values.shape[0], device=values.device)
    page = pages[positions // block_size].long()
    offset = positions % block_size
    if cache.dim() == 4:
        cache[page, :, offset] = values
    else:
        cache[page, offset] = values


def paged_batch(
    requests: list[tuple[int, int]],
    *,
    num_kv_heads: int,
    head_dim: int,
    index_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator,
    spare_pages: int = 3,
) -> PagedBatch:
    """``requests`` are ``(context_len, new_tokens)``: the last ``new_tokens`` positions are this
    step's queries, the earlier ones a cached prefix.  Pages are drawn from a shuffled pool with
    ``spare_pages`` never used; every slot that holds no key is NaN, so a kernel that reads one shows."""
    blocks = [-(-context // block_size) for context, _ in requests]
    num_pages = sum(blocks) + spare_pages
    order = torch.randperm(num_pages, generator=generator).to(torch.int32)
    page_table = torch.zeros((len(requests), max(blocks, default=1)), dtype=torch.int32)
    nan = float("nan")
    key_cache = torch.full((num_pages, num_kv_heads, block_size, head_dim), nan, dtype=dtype, device=device)
    value_cache = torch.full_like(key_cache, nan)
    index_key_cache = torch.full((num_pages, block_size, index_dim), nan, dtype=dtype, device=device)
    keys, values, index_keys, positions, token_ranges = [], [], [], [], []
    next_page, next_token = 0, 0
    for request, (context, new_tokens) in enumerate(requests):
        if not 0 < new_tokens <= context:
            raise ValueError(f"request {request}: need 0 < new_tokens <= context, got {new_tokens}, {context}")
        pages = order[next_page : next_page + blocks[request]]
        page_table[request, : blocks[request]] = pages
        next_page += blocks[request]

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=generator).to(dtype=dtype, device=device)

        keys.append(randn(context, num_kv_heads, head_dim))
        values.append(randn(context, num_kv_heads, head_dim))
        index_keys.append(randn(context, index_dim))
        pages_on_device = pages.to(device)
        _scatter(key_cache, pages_on_device, keys[-1], block_size)
        _scatter(value_cache, pages_on_device, values[-1], block_size)
        _scatter(index_key_cache, pages_on_device, index_keys[-1], block_size)
        positions.append(torch.arange(context - new_tokens, context))
        token_ranges.append((next_token, next_token + new_tokens))
        next_token += new_tokens
    query_lens = torch.tensor([new for _, new in requests], dtype=torch.int32)
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    seq_lens = torch.tensor([context for context, _ in requests], dtype=torch.int32)
    flat_positions = torch.cat(positions)
    request_of_token = torch.repeat_interleave(torch.arange(len(requests)), query_lens.long())
    slot_mapping = page_table[request_of_token, flat_positions // block_size].long() * block_size + (
        flat_positions % block_size
    )
    metadata = AttentionMetadata(
        block_size=block_size,
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        positions=flat_positions.to(device),
        slot_mapping=slot_mapping.to(device),
        page_table=page_table.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return PagedBatch(metadata, key_cache, value_cache, index_key_cache, keys, values, index_keys, token_ranges)


def assert_selection_matches(
    selection: torch.Tensor,
    expected: torch.Tensor,
    block_scores: torch.Tensor,
    local_blocks: int,
    tolerance: float,
) -> None:
    """Rows must equal ``expected`` except where near-ties decide: a ranked block may differ only if
    its score lies within ``tolerance`` of the row's cut-off (the lowest ranked score ``expected``
    kept), as summing in another order or precision may legitimately flip such ties.  The local
    blocks (the last valid entries) must match exactly."""
    selection = selection.long().cpu()
    expected = expected.long().cpu()
    scores = block_scores.cpu()
    assert selection.shape == expected.shape, (selection.shape, expected.shape)
    assert torch.equal(selection < 0, expected < 0), "different numbers of valid entries"
    for head, token in (selection != expected).any(-1).nonzero().tolist():
        valid = int((expected[head, token] >= 0).sum())
        num_ranked = max(0, valid - local_blocks)
        assert torch.equal(selection[head, token, num_ranked:], expected[head, token, num_ranked:]), (
            f"head {head} token {token}: local blocks differ: {selection[head, token]} vs {expected[head, token]}"
        )
        got = set(selection[head, token, :num_ranked].tolist())
        want = set(expected[head, token, :num_ranked].tolist())
        if got == want:
            continue  # same set, ranked order differs on a near-tie
        row_scores = scores[head, token]
        cutoff = min(float(row_scores[b]) for b in want)
        for block in got ^ want:
            assert abs(float(row_scores[block]) - cutoff) <= tolerance, (
                f"head {head} token {token}: block {block} scores {float(row_scores[block])}, cut-off {cutoff}; "
                f"got {sorted(got)}, expected {sorted(want)}"
            )
