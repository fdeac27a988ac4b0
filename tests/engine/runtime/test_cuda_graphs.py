"""Padded decode batches (the CUDA-graph inputs), checked on CPU: padding rows never change the real rows.

Graph capture itself needs CUDA (tests/gpu/test_runtime.py); the padding semantics it relies on do not.
"""

import numpy as np
import torch

from m3stack.engine.runtime.cuda_graphs import PaddedDecodeBuffers, capture_sizes
from m3stack.engine.runtime.inputs import build_host_inputs, to_device
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request


def test_capture_sizes_cover_every_batch_up_to_the_maximum():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def _decode_step(core, prompts):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add_request(build_request(core.info, f"r{index}", prompt, sampling))
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()
    out = core.scheduler.schedule()
    assert all(s.num_new_tokens == 1 for s in out.requests)
    return out


def test_padding_rows_leave_the_real_rows_logits_unchanged(build_core):
    core = build_core()
    out = _decode_step(core, [list(range(5, 5 + n)) for n in (3, 40, 17)])
    host = build_host_inputs(out, core.info.block_size)
    model, backend = core.runner.model, core.runner.backend
    with torch.inference_mode():
        eager = to_device(host, core.info.block_size, torch.device("cpu"), core.scheduler.encoder_cache)
        backend.begin_step(eager.metadata)
        expected = model.compute_logits(model.forward(eager.input_ids, eager.positions, backend, None, None))

        buffers = PaddedDecodeBuffers(
            torch.device("cpu"), block_size=core.info.block_size, max_batch=8, max_model_len=core.info.max_model_len
        )
        assert buffers.fits(host)
        metadata = buffers.stage(host, size=8)
        backend.begin_step(metadata)
        hidden = model.forward(buffers.input_ids[:8], buffers.positions[:8], backend, None, None)
        padded = model.compute_logits(hidden)
    # The KV cache was poisoned with NaN: the padding rows read the null page, the real rows must not.
    assert torch.isfinite(padded[:3]).all()
    torch.testing.assert_close(padded[:3], expected, rtol=1e-5, atol=1e-5)
    assert metadata.seq_lens_cpu.tolist() == [*host.seq_lens.tolist(), 1, 1, 1, 1, 1]
    assert buffers.slot_mapping[3:8].tolist() == [-1] * 5


def test_staging_clears_what_a_wider_earlier_batch_left(build_core):
    core = build_core()
    out = _decode_step(core, [list(range(1, 60)), [7, 8]])
    host = build_host_inputs(out, core.info.block_size)
    buffers = PaddedDecodeBuffers(
        torch.device("cpu"), block_size=16, max_batch=4, max_model_len=core.info.max_model_len
    )
    buffers.stage(host, size=4)
    assert buffers.page_table[0, :4].tolist() == host.page_table[0, :4].tolist()
    narrow = build_host_inputs(type(out)(requests=out.requests[1:]), core.info.block_size)
    buffers.stage(narrow, size=2)
    assert buffers.page_table[0, 1:].eq(0).all() and buffers.page_table[1].eq(0).all()
    assert buffers.page_table[0, 0] == int(narrow.page_table[0, 0])
    assert np.array_equal(buffers.input_ids[:1].numpy(), narrow.input_ids)


def test_every_staged_input_starts_16_byte_aligned_like_an_eager_steps():
    # Triton compiles a kernel variant per pointer alignment: a misaligned view in the graphs' buffers makes the
    # first eager decode step (aligned fresh uploads) compile its own variants mid-serving.
    for max_batch in (1, 2, 3, 5, 8, 33):
        buffers = PaddedDecodeBuffers(torch.device("cpu"), block_size=16, max_batch=max_batch, max_model_len=200)
        metadata = buffers.metadata(max_batch)
        views = {"input_ids": buffers.input_ids, "positions": metadata.positions, "slots": metadata.slot_mapping,
                 "seq_lens": metadata.seq_lens, "page_table": metadata.page_table}  # fmt: skip
        misaligned = {name: view.data_ptr() % 16 for name, view in views.items() if view.data_ptr() % 16}
        assert not misaligned, f"max_batch {max_batch}: {misaligned}"
        assert buffers.page_table.shape == (max_batch, 13) and buffers.positions.shape == (max_batch,)
