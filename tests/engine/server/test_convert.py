"""engine.proto <-> runtime: tensor payloads bit-exact per dtype, unset vs zero sampling fields, responses."""

import pytest
import torch

from m3stack.engine.runtime.request import FinishReason, RequestOutput, SamplingParams
from m3stack.engine.server.convert import pixel_digest, responses_from_outputs, sampling_from_proto, tensor_from_proto
from m3stack.proto import engine_pb2 as pb

WIRE = {
    torch.uint8: pb.DTYPE_UINT8,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.float32: pb.DTYPE_FLOAT32,
}


@pytest.mark.parametrize("dtype", list(WIRE))
def test_inline_tensors_arrive_bit_exact(dtype):
    generator = torch.Generator().manual_seed(4)
    if dtype == torch.uint8:
        original = torch.randint(0, 256, (5, 7), dtype=torch.uint8, generator=generator)
    else:
        original = torch.randn((5, 7), generator=generator).to(dtype)
    message = pb.Tensor(shape=[5, 7], dtype=WIRE[dtype], inline_data=original.view(torch.uint8).numpy().tobytes())
    received = tensor_from_proto(message, "t", max_bytes=1 << 20)
    assert received.dtype == dtype and torch.equal(received.view(torch.uint8), original.view(torch.uint8))


@pytest.mark.parametrize("dtype", list(WIRE))
def test_the_pixel_digest_follows_the_bytes_the_dtype_and_the_shape(dtype):
    """The engine's cache key for an item: equal for equal pixels, different for one changed value, for the
    same bytes as another dtype, and for the same values in another shape."""
    pixels = torch.arange(48, dtype=torch.float32).reshape(4, 12).to(dtype)
    digest = pixel_digest(pixels)
    assert pixel_digest(pixels.clone()) == digest
    changed = pixels.clone()
    changed[3, 11] = 7
    same_bytes = pixels.view(torch.uint8) if dtype != torch.uint8 else pixels.view(torch.int8)
    others = [changed, pixels.reshape(6, 8), same_bytes]
    assert len({digest, *(pixel_digest(other) for other in others)}) == 1 + len(others)


def test_unset_sampling_fields_take_the_openai_defaults_and_zero_is_not_unset():
    assert sampling_from_proto(pb.SamplingParams()) == SamplingParams()
    explicit = sampling_from_proto(pb.SamplingParams(temperature=0.0, top_k=0, min_p=0.0, seed=0, max_new_tokens=5))
    assert explicit.temperature == 0.0 and explicit.greedy and explicit.seed == 0 and explicit.max_new_tokens == 5
    assert sampling_from_proto(pb.SamplingParams(top_logprobs=2)).wants_logprobs


def test_outputs_of_several_steps_become_one_chunk_then_the_completion():
    outputs = [
        RequestOutput("r", new_token_ids=[5], new_logprobs=[-0.5], new_top_logprobs=[([5, 6], [-0.5, -1.0])],
                      num_prompt_tokens=3, num_output_tokens=1),
        RequestOutput("r", new_token_ids=[], num_prompt_tokens=3, num_output_tokens=2, num_cached_tokens=2,
                      finish_reason=FinishReason.STOP, stop_token_id=9),
    ]  # fmt: skip
    chunk, complete = responses_from_outputs("r", outputs)
    assert list(chunk.chunk.token_ids) == [5] and list(chunk.chunk.logprobs) == [-0.5]
    assert list(chunk.chunk.top_logprobs[0].token_ids) == [5, 6]
    assert complete.complete.finish_reason == pb.FINISH_REASON_STOP
    assert complete.complete.HasField("matched_stop_token_id") and complete.complete.matched_stop_token_id == 9
    assert (complete.complete.prompt_tokens, complete.complete.completion_tokens) == (3, 2)
    assert complete.complete.cached_tokens == 2
    (only,) = responses_from_outputs("r", [RequestOutput("r", finish_reason=FinishReason.LENGTH)])
    assert only.complete.finish_reason == pb.FINISH_REASON_LENGTH and not only.complete.HasField(
        "matched_stop_token_id"
    )
