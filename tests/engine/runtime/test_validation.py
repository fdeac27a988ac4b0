"""``build_request``: prompts as lists, numpy arrays and protobuf fields give the same request; malformed token ids
get an ``InvalidRequestError`` that says what is wrong."""

import numpy as np
import pytest

from m3stack.engine.runtime.errors import InvalidRequestError
from m3stack.engine.runtime.model_info import ModelInfo
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request
from m3stack.proto import engine_pb2 as pb

INFO = ModelInfo(
    model_path="unit",
    served_model_name="unit",
    model_type="minimax_m3_vl",
    vocab_size=1000,
    max_model_len=4096,
    eos_token_ids=(2,),
    bos_token_id=1,
    block_size=16,
    image_token_id=900,
    video_token_id=901,
    patch_dim=12,
    spatial_merge_size=2,
    supports_vision=False,
    dtype="float32",
    device="cpu",
    num_kv_blocks=1024,
)
SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=4)


def test_lists_arrays_and_protobuf_fields_give_the_same_prompt():
    prompt = list(np.random.default_rng(0).integers(0, 900, 3000))
    field = pb.GenerateRequest(input_ids=prompt).input_ids
    requests = [build_request(INFO, "r", source, SAMPLING) for source in (prompt, np.array(prompt), field)]
    for request in requests:
        assert request.token_ids == [int(t) for t in prompt]
        assert all(type(t) is int for t in request.token_ids[:5])
        assert request.max_tokens == 4


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "input_ids is empty"),
        ([1, 1000, 3, -4], "input_ids [1000, -4] are outside the vocabulary [0, 1000)"),
        ([1, 2.5], "input_ids must be a flat list of integers"),
        ([[1, 2], [3, 4]], "input_ids must be a flat list of integers"),
        ([1, "7"], "input_ids must be a flat list of integers"),
        ([1, 2**70, -(2**70)], f"input_ids [{2**70}, {-(2**70)}] are outside the vocabulary [0, 1000)"),
        ([True, False], "input_ids must be a flat list of integers"),
        (np.array([1, 2**63 + 5], dtype=np.uint64), f"input_ids [{2**63 + 5}] are outside the vocabulary"),
        ([5] * 4096, "the prompt has 4096 tokens; the context limit is 4096"),
        ([5, 900, 6], "input_ids[1] is an image/video placeholder token outside every mm_items placeholder range"),
    ],
)
def test_malformed_prompts_are_refused_with_the_reason(prompt, message):
    with pytest.raises(InvalidRequestError) as caught:
        build_request(INFO, "r", prompt, SAMPLING)
    assert message in str(caught.value)
