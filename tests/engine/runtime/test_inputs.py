"""Step inputs: the flat varlen layout and the paged-cache addressing, against a token-by-token rebuild."""

import random

import numpy as np
import torch

from m3stack.engine.kv_cache.manager import KVCacheManager
from m3stack.engine.runtime.encoder_cache import EncoderCache
from m3stack.engine.runtime.inputs import build_host_inputs, to_device
from m3stack.engine.runtime.request import SampledToken
from m3stack.engine.runtime.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


def test_rows_positions_slots_and_pages_match_a_token_by_token_rebuild(new_request, new_image):
    rng = random.Random(3)
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=24),
        KVCacheManager(64, BLOCK),
        EncoderCache(64),
    )
    requests = [new_request([rng.randrange(100) for _ in range(n)]) for n in (3, 9, 30)]
    requests.append(new_request(list(range(14)), mm_inputs=[new_image("img", range(4, 10))]))
    for request in requests:
        scheduler.add_request(request)
    steps_with_images = 0
    for _ in range(4):  # a mix of decodes and prefill chunks
        out = scheduler.schedule()
        for item in out.encoder_items:
            scheduler.encoder_cache.put(item.content_hash, torch.randn(item.num_embeds, 8))
        host = build_host_inputs(out, BLOCK)

        row = 0
        expected_mm_rows = []
        for r, scheduled in enumerate(out.requests):
            assert host.query_start_loc[r] == row
            assert host.seq_lens[r] == scheduled.start + scheduled.num_new_tokens
            for pos in range(scheduled.start, scheduled.start + scheduled.num_new_tokens):
                assert host.input_ids[row] == scheduled.request.token_ids[pos]
                assert host.positions[row] == pos
                page = scheduled.block_ids[pos // BLOCK]
                assert host.slot_mapping[row] == page * BLOCK + pos % BLOCK
                for item in scheduled.request.mm_inputs:
                    if pos in item.embed_positions.tolist():
                        expected_mm_rows.append(row)
                row += 1
            pages = -(-(scheduled.start + scheduled.num_new_tokens) // BLOCK)
            assert host.page_table[r, :pages].tolist() == scheduled.block_ids[:pages].tolist()
            assert not host.page_table[r, pages:].any()
        assert host.query_start_loc[-1] == row
        assert host.mm_rows.tolist() == expected_mm_rows
        assert host.logits_rows.tolist() == [
            int(host.query_start_loc[r + 1]) - 1 for r, s in enumerate(out.requests) if s.samples
        ]

        device_inputs = to_device(host, BLOCK, torch.device("cpu"), scheduler.encoder_cache)
        if expected_mm_rows:
            steps_with_images += 1
            image = next(r for r in requests if r.mm_inputs).mm_inputs[0]
            embeds = scheduler.encoder_cache.get(image.content_hash)
            positions = device_inputs.positions[device_inputs.mm_rows]
            assert torch.equal(device_inputs.mm_embeds, embeds[positions - image.first_embed])
        scheduler.update(out, {s.request.request_id: SampledToken(1) for s in out.requests if s.samples})
    assert steps_with_images == 1


def test_plain_decode_inputs_equal_the_general_layout(new_request):
    """The decode fast path against the general builder, over steps that cross page boundaries and carry
    placeholders (each step is scheduled before the previous one's tokens are applied, as with async scheduling)."""
    from m3stack.engine.runtime.inputs import _mixed_inputs, _plain_decode_inputs

    rng = random.Random(5)
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64),
        KVCacheManager(64, BLOCK),
        EncoderCache(64),
    )
    for n in (1, 3, 4, 7, 9):
        scheduler.add_request(new_request([rng.randrange(100) for _ in range(n)], max_tokens=16))
    previous = scheduler.schedule()  # the prefill
    decode_steps = 0
    for _ in range(9):
        out = scheduler.schedule()
        if all(s.num_new_tokens == 1 and s.samples for s in out.requests):
            decode_steps += 1
            fast, general = _plain_decode_inputs(out.requests, BLOCK), _mixed_inputs(out.requests, BLOCK)
            assert len(fast.placeholder_rows) == len(out.requests)
            for name, value in vars(general).items():
                if isinstance(value, np.ndarray):
                    assert value.dtype == getattr(fast, name).dtype, name
                    assert np.array_equal(value, getattr(fast, name)), name
                else:
                    assert value == getattr(fast, name), name
        scheduler.update(previous, {s.request.request_id: SampledToken(7) for s in previous.requests if s.samples})
        previous = out
    assert decode_steps >= 8
