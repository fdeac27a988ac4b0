"""Bad requests get INVALID_ARGUMENT with a message saying what is wrong, and a request running meanwhile is untouched.

Also: images over inline bytes and POSIX shared memory (uint8 and float), and that the engine
unlinks every shared-memory segment it is handed, read or rejected.
"""

import os
import threading
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest

from m3stack.proto import engine_pb2 as pb

GRID = (1, 4, 4)  # 16 patches -> 4 image tokens
SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def info(server):
    return server.core.info


def _pixels(info, dtype=np.float32, patches: int = 16) -> np.ndarray:
    rng = np.random.default_rng(1)
    if dtype == np.uint8:
        return rng.integers(0, 256, (patches, info.patch_dim), dtype=np.uint8)
    return rng.standard_normal((patches, info.patch_dim)).astype(dtype)


def _grids(*grids: tuple[int, int, int]) -> list[pb.VisionGrid]:
    return [pb.VisionGrid(t=t, h=h, w=w) for t, h, w in grids]


def _tensor(array: np.ndarray, dtype=pb.DTYPE_FLOAT32) -> pb.Tensor:
    return pb.Tensor(shape=list(array.shape), dtype=dtype, inline_data=array.tobytes())


def _image_request(info, request_id="img", *, item_changes=None, prompt=None) -> pb.GenerateRequest:
    prompt = prompt if prompt is not None else [5, 6, *[info.image_token_id] * 4, 7, 8]
    item = pb.MultimodalItem(
        modality=pb.MODALITY_IMAGE,
        pixel_values=_tensor(_pixels(info)),
        grids=_grids(GRID),
        placeholders=[pb.PlaceholderRange(offset=2, length=4)],
        content_hash=f"hash-{request_id}",
    )
    for key, value in (item_changes or {}).items():
        if key == "placeholders":
            del item.placeholders[:]
            item.placeholders.extend(pb.PlaceholderRange(offset=o, length=n) for o, n in value)
        elif key == "grids":
            del item.grids[:]
            item.grids.extend(_grids(*value))
        elif key == "pixel_values":
            item.pixel_values.CopyFrom(value)
        else:
            setattr(item, key, value)
    return pb.GenerateRequest(
        request_id=request_id,
        input_ids=prompt,
        mm_items=[item],
        sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=3),
    )


def _text_request(request_id="t", prompt=(1, 2, 3), **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, input_ids=list(prompt), sampling=pb.SamplingParams(**sampling))


def _expect_invalid(server, request: pb.GenerateRequest, phrase: str) -> None:
    with pytest.raises(grpc.RpcError) as failure:
        list(server.stub.Generate(request, timeout=30))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value.details()
    assert phrase in failure.value.details(), failure.value.details()


@pytest.fixture
def bystander(server):
    """A long request that runs while the bad ones are refused; it must finish normally."""
    request = _text_request("bystander", range(1, 30), temperature=0.0, max_new_tokens=30, ignore_eos=True)
    results = []
    call = server.stub.Generate(request, timeout=120)
    next(call)
    thread = threading.Thread(target=lambda: results.extend(call))
    thread.start()
    yield
    thread.join(120)
    assert results and results[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH
    assert results[-1].complete.completion_tokens == 30
    server.wait_idle()


TEXT_CASES = [
    ({"prompt": (1, 10**6)}, {}, "outside the vocabulary"),
    ({"prompt": ()}, {}, "input_ids is empty"),
    ({"prompt": [1] * 600}, {}, "context limit is 512"),
    ({"request_id": ""}, {}, "request_id must have"),
    ({}, {"temperature": -1.0}, "temperature"),
    ({}, {"temperature": float("nan")}, "temperature"),
    ({}, {"top_p": 0.0}, "top_p"),
    ({}, {"min_p": 1.5}, "min_p"),
    ({}, {"top_logprobs": 21}, "top_logprobs"),
    ({}, {"max_new_tokens": 0}, "max_new_tokens"),
    ({}, {"max_new_tokens": 2, "min_new_tokens": 3}, "min_new_tokens"),
    ({}, {"stop_token_ids": [10**7]}, "stop_token_ids"),
]


def test_bad_text_requests(server, bystander):
    for request_fields, sampling, phrase in TEXT_CASES:
        _expect_invalid(server, _text_request(**request_fields, **sampling), phrase)


def _image_cases(info) -> list[tuple[dict, list[int] | None, str]]:
    raw = _pixels(info)
    image = info.image_token_id
    return [
        ({"modality": pb.MODALITY_UNSPECIFIED}, None, "modality is unspecified"),
        ({"pixel_values": pb.Tensor(shape=[16, info.patch_dim], inline_data=raw.tobytes())}, None, "dtype"),
        (
            {"pixel_values": pb.Tensor(shape=[16, info.patch_dim], dtype=pb.DTYPE_FLOAT32, inline_data=b"x" * 10)},
            None,
            "inline_data has 10 bytes",
        ),
        ({"pixel_values": pb.Tensor(shape=[1 << 20, info.patch_dim], dtype=pb.DTYPE_FLOAT32)}, None, "over the"),
        ({"pixel_values": pb.Tensor(shape=[0, 3], dtype=pb.DTYPE_FLOAT32)}, None, "positive sizes"),
        ({"pixel_values": pb.Tensor(shape=[16, info.patch_dim], dtype=pb.DTYPE_FLOAT32)}, None, "no payload"),
        ({"pixel_values": _tensor(np.full((16, info.patch_dim), np.nan, np.float32))}, None, "NaN"),
        ({"pixel_values": _tensor(raw[:8])}, None, "need [16, 1176]"),
        ({"grids": []}, None, "grids is empty"),
        ({"grids": [(0, 4, 4)]}, None, "grids[0] must be 3 positive integers"),
        ({"grids": [(1, 3, 4)]}, None, "multiples of the merge size"),
        ({"grids": [(1, 2, 4), (1, 2, 4)]}, None, "is an image: one grid with t = 1"),
        ({"grids": [(2, 2, 4)]}, None, "is an image: one grid with t = 1"),
        ({"placeholders": [(2, 3)]}, None, "hold 3 image tokens"),
        ({"placeholders": [(6, 4)]}, None, "inside the 8-token prompt"),
        ({"placeholders": [(3, 2), (2, 2)]}, None, "sorted, disjoint"),
        ({"placeholders": []}, None, "placeholders is empty"),
        ({"content_hash": ""}, None, "content_hash is empty"),
        ({}, [5, 6, image, image, image, image, 7, image], "outside every mm_items placeholder range"),
        ({"modality": pb.MODALITY_VIDEO}, None, "video tokens"),
    ]


def test_bad_image_requests(server, bystander, info):
    for index, (changes, prompt, phrase) in enumerate(_image_cases(info)):
        _expect_invalid(server, _image_request(info, f"bad-{index}", item_changes=changes, prompt=prompt), phrase)


def test_overlapping_items_are_refused(server, info):
    request = _image_request(info, "overlap")
    request.mm_items.append(request.mm_items[0])
    _expect_invalid(server, request, "overlapping placeholder ranges")


def _write_segment(array: np.ndarray, prefix: bytes = b"") -> str:
    name = f"m3stack-test-{uuid.uuid4().hex}"
    (SHM / name).write_bytes(prefix + array.tobytes())
    return name


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_an_image_through_shared_memory_matches_inline_and_the_segment_is_unlinked(server, info, dtype):
    pixels = _pixels(info, dtype)
    wire = pb.DTYPE_UINT8 if dtype == np.uint8 else pb.DTYPE_FLOAT32
    inline = _image_request(info, f"inline-{dtype.__name__}", item_changes={"pixel_values": _tensor(pixels, wire)})
    expected = [t for r in server.stub.Generate(inline) if r.HasField("chunk") for t in r.chunk.token_ids]
    name = _write_segment(pixels, prefix=b"\0" * 64)
    tensor = pb.Tensor(
        shape=list(pixels.shape), dtype=wire, shm=pb.ShmHandle(name=name, offset=64, nbytes=pixels.nbytes)
    )
    via_shm = _image_request(
        info, f"shm-{dtype.__name__}", item_changes={"pixel_values": tensor, "content_hash": f"shm-{dtype.__name__}"}
    )
    tokens = [t for r in server.stub.Generate(via_shm) if r.HasField("chunk") for t in r.chunk.token_ids]
    assert len(expected) == 3 and tokens == expected
    assert not (SHM / name).exists()


def test_bad_shared_memory_handles_are_refused_and_never_leak(server, info):
    pixels = _pixels(info)
    name = _write_segment(pixels)
    cases = [
        (pb.ShmHandle(name="../etc/passwd", nbytes=pixels.nbytes), "not a plain shared-memory segment name"),
        (pb.ShmHandle(name=f"missing-{uuid.uuid4().hex}", nbytes=pixels.nbytes), "does not exist"),
        (pb.ShmHandle(name=name, offset=8, nbytes=pixels.nbytes), "exceeds the"),
    ]
    for index, (handle, phrase) in enumerate(cases):
        tensor = pb.Tensor(shape=list(pixels.shape), dtype=pb.DTYPE_FLOAT32, shm=handle)
        _expect_invalid(server, _image_request(info, f"shm-bad-{index}", item_changes={"pixel_values": tensor}), phrase)
    assert not (SHM / name).exists()  # the rejected segment was unlinked too
    assert os.path.exists("/etc/passwd")


def test_an_image_and_a_video_in_one_prompt_and_their_prefix_cache_reuse(server, info):
    image, video = info.image_token_id, info.video_token_id
    # Text ids no other test of this module's shared server starts a prompt with: its prefix cache is empty here.
    prompt = [*range(201, 221), *[image] * 4, *range(230, 250), *[video] * 8, *range(260, 270)]  # 62 tokens
    rng = np.random.default_rng(7)

    def item(modality, grid, offset, length, content_hash):
        patches = int(np.prod(grid))
        pixels = rng.integers(0, 256, (patches, info.patch_dim), dtype=np.uint8)
        return pb.MultimodalItem(modality=modality, pixel_values=_tensor(pixels, pb.DTYPE_UINT8), grids=_grids(grid),
                                 placeholders=[pb.PlaceholderRange(offset=offset, length=length)],
                                 content_hash=content_hash)  # fmt: skip

    items = [
        item(pb.MODALITY_IMAGE, [1, 4, 4], 20, 4, "mixed-img"),
        item(pb.MODALITY_VIDEO, [2, 4, 4], 44, 8, "mixed-vid"),
    ]
    sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    runs = []
    for request_id in ("mixed-1", "mixed-2"):
        request = pb.GenerateRequest(request_id=request_id, input_ids=prompt, mm_items=items, sampling=sampling)
        responses = list(server.stub.Generate(request, timeout=60))
        tokens = [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]
        runs.append((tokens, responses[-1].complete))
    (first, first_end), (second, second_end) = runs
    assert len(first) == 4 and second == first
    assert first_end.cached_tokens == 0 and second_end.cached_tokens == 48  # 3 full blocks, images included
    # Another image behind the same placeholder tokens shares only the block before it (tokens 0-15).
    other = pb.GenerateRequest(request_id="mixed-3", input_ids=prompt, sampling=sampling,
                               mm_items=[item(pb.MODALITY_IMAGE, [1, 4, 4], 20, 4, "other-img"), items[1]])  # fmt: skip
    assert list(server.stub.Generate(other, timeout=60))[-1].complete.cached_tokens == 16
    # Other pixels under the first image's content_hash: the engine keys its caches by the pixels it got, so they
    # are neither served the first image's cached blocks nor able to replace them.
    forged_image = item(pb.MODALITY_IMAGE, [1, 4, 4], 20, 4, "mixed-img")
    forged = pb.GenerateRequest(request_id="mixed-4", input_ids=prompt, sampling=sampling,
                                mm_items=[forged_image, items[1]])  # fmt: skip
    assert list(server.stub.Generate(forged, timeout=60))[-1].complete.cached_tokens == 16
    again = pb.GenerateRequest(request_id="mixed-5", input_ids=prompt, mm_items=items, sampling=sampling)
    responses = list(server.stub.Generate(again, timeout=60))
    assert [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids] == first
    assert responses[-1].complete.cached_tokens == 48
    server.wait_idle()


def _video_request(info, request_id: str, grids, placeholders) -> pb.GenerateRequest:
    """Three temporal patches of 2x4 patches (2 video tokens each), each after its own timestamp-like text."""
    video = info.video_token_id
    prompt = [5, 6, 40, video, video, 41, video, video, 42, video, video, 7, 8]
    pixels = np.random.default_rng(3).integers(0, 256, (3 * 8, info.patch_dim), dtype=np.uint8)
    item = pb.MultimodalItem(
        modality=pb.MODALITY_VIDEO,
        pixel_values=_tensor(pixels, pb.DTYPE_UINT8),
        grids=_grids(*grids),
        placeholders=[pb.PlaceholderRange(offset=o, length=n) for o, n in placeholders],
        content_hash=f"video-{request_id}",
    )
    sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, input_ids=prompt, mm_items=[item], sampling=sampling)


PER_FRAME_RANGES = [(3, 2), (6, 2), (9, 2)]


def test_a_video_of_several_vision_segments_is_served(server, info):
    # Segments of at most two temporal patches: (2, 2, 4) then (1, 2, 4), as a long video's grids arrive.
    request = _video_request(info, "segments", [(2, 2, 4), (1, 2, 4)], PER_FRAME_RANGES)
    responses = list(server.stub.Generate(request, timeout=60))
    assert responses[-1].complete.completion_tokens == 3


def test_video_grids_that_disagree_with_the_pixels_or_the_prompt_are_refused(server, bystander, info):
    cases = [
        ([(2, 2, 4), (2, 2, 4)], PER_FRAME_RANGES, "need [32, 1176]"),
        ([(2, 2, 4), (1, 4, 2)], PER_FRAME_RANGES, "grids differ in h or w"),
        # One range holding the first two frames' tokens and the third's: the first segment (one temporal patch)
        # would end inside it.
        ([(1, 2, 4), (2, 2, 4)], [(3, 5), (9, 2)], "grids[0] ends after 2 embeddings, inside a placeholder range"),
    ]
    for index, (grids, placeholders, phrase) in enumerate(cases):
        _expect_invalid(server, _video_request(info, f"bad-video-{index}", grids, placeholders), phrase)
