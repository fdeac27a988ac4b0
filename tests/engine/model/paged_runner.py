"""A minimal model runner for tests: sequences on shuffled pages of a NaN-poisoned paged cache.

It builds ``AttentionMetadata`` exactly as the engine runtime must (flat varlen batch, one page table, slots =
page * B + offset), so the model and the reference backend are tested through their real interfaces.  Pages are
handed out in a shuffled order so page tables are never the identity, and every cache starts as NaN so a read
of an unwritten slot poisons the output.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from m3stack.engine.attention.backend import AttentionBackend
from m3stack.engine.attention.reference import ReferenceAttentionBackend
from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import LayerKVCache, allocate_kv_cache
from m3stack.engine.model.model import M3ForServing


@dataclass
class Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens already in the cache


@dataclass
class Chunk:
    """New tokens of one sequence in one step, with the multimodal embeddings of its placeholder rows."""

    sequence: Sequence
    input_ids: torch.Tensor  # [n] int64
    mm_rows: torch.Tensor | None = None  # [m] rows of this chunk that take mm_embeds
    mm_embeds: torch.Tensor | None = None  # [m, hidden]


class PagedRunner:
    def __init__(
        self,
        model: M3ForServing,
        num_pages: int,
        device: torch.device | str,
        seed: int = 0,
        topk_blocks: int | None = None,
        backend_factory: Callable[[list[LayerKVCache]], AttentionBackend] | None = None,
        index_dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = model.config.text.index_block_size
        spec = replace(model.kv_cache_spec(), index_dtype=index_dtype, kv_dtype=kv_dtype)
        caches = allocate_kv_cache(spec, num_pages, self.device)
        for cache in caches:
            for tensor in (cache.key, cache.value, cache.index_key, cache.index_key_scale):
                if tensor is not None:
                    tensor.fill_(float("nan"))
        text = model.config.text
        self.backend = (
            backend_factory(caches)
            if backend_factory is not None
            else ReferenceAttentionBackend(
                caches, topk_blocks=topk_blocks or text.index_topk_blocks, local_blocks=text.index_local_blocks
            )
        )
        self.free_pages = list(range(num_pages))
        random.Random(seed).shuffle(self.free_pages)

    def step(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run one engine step; float32 logits ``[sum of chunk lengths, vocab]`` for every new token."""
        starts, seq_lens, positions, slots, rows, embeds = [0], [], [], [], [], []
        for chunk in chunks:
            seq = chunk.sequence
            new = chunk.input_ids.shape[0]
            end = seq.length + new
            while len(seq.pages) * self.block_size < end:
                seq.pages.append(self.free_pages.pop())
            pos = torch.arange(seq.length, end)
            page_ids = torch.tensor(seq.pages)[pos // self.block_size]
            positions.append(pos)
            slots.append(page_ids * self.block_size + pos % self.block_size)
            if chunk.mm_rows is not None:
                rows.append(chunk.mm_rows + starts[-1])
                embeds.append(chunk.mm_embeds)
            starts.append(starts[-1] + new)
            seq_lens.append(end)
            seq.length = end
        max_pages = max(len(c.sequence.pages) for c in chunks)
        page_table = torch.zeros((len(chunks), max_pages), dtype=torch.int32)
        for r, chunk in enumerate(chunks):
            page_table[r, : len(chunk.sequence.pages)] = torch.tensor(chunk.sequence.pages, dtype=torch.int32)
        query_start_loc = torch.tensor(starts, dtype=torch.int32)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        flat_positions = torch.cat(positions)
        metadata = AttentionMetadata(
            block_size=self.block_size,
            query_start_loc=query_start_loc.to(self.device),
            seq_lens=seq_lens_t.to(self.device),
            positions=flat_positions.to(self.device),
            slot_mapping=torch.cat(slots).to(self.device),
            page_table=page_table.to(self.device),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens_t,
        )
        self.backend.begin_step(metadata)
        input_ids = torch.cat([c.input_ids for c in chunks]).to(self.device)
        mm_rows = torch.cat(rows).to(self.device) if rows else None
        mm_embeds = torch.cat(embeds) if embeds else None
        hidden = self.model.forward(input_ids, flat_positions.to(self.device), self.backend, mm_rows, mm_embeds)
        return self.model.compute_logits(hidden)

    def greedy(self, prompt: Chunk, num_tokens: int, prefill_chunk: int | None = None) -> tuple[torch.Tensor, list]:
        """Prefill ``prompt`` (in pieces of ``prefill_chunk`` tokens if given), then decode greedily.

        Returns the prompt's logits ``[n, vocab]`` and the ``num_tokens`` generated ids.
        """
        logits = self.prefill(prompt, prefill_chunk)
        tokens = [int(logits[-1].argmax())]
        while len(tokens) < num_tokens:
            step = self.step([Chunk(prompt.sequence, torch.tensor([tokens[-1]]))])
            tokens.append(int(step[-1].argmax()))
        return logits, tokens

    def prefill(self, prompt: Chunk, prefill_chunk: int | None = None) -> torch.Tensor:
        size = prefill_chunk or prompt.input_ids.shape[0]
        pieces = []
        for start in range(0, prompt.input_ids.shape[0], size):
            stop = start + size
            rows = embeds = None
            if prompt.mm_rows is not None:
                keep = (prompt.mm_rows >= start) & (prompt.mm_rows < stop)
                rows, embeds = prompt.mm_rows[keep] - start, prompt.mm_embeds[keep]
            pieces.append(self.step([Chunk(prompt.sequence, prompt.input_ids[start:stop], rows, embeds)]))
        return torch.cat(pieces)
