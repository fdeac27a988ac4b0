"""Videos long enough to span several vision-attention segments, from the HTTP API to the vision tower.

The gateway cuts a video into segments of at most ``vision_segment_max_frames`` temporal patches and the engine
must receive one grid per segment: a 30 s clip at 1 sampled frame per second is 15 temporal patches, four
segments (4, 4, 4, 3).  The embeddings the engine computes from what crosses the wire equal transformers'
``minimax_m3_vl`` processor + model, and whole requests through the openai client generate transformers'
greedy tokens.
"""

import asyncio

import openai
import pytest
import torch
from transformers import AutoProcessor
from transformers.video_utils import VideoMetadata

from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request
from m3stack.engine.server.convert import mm_items_from_proto
from m3stack.gateway.engine_client import wire
from m3stack.gateway.multimodal import MediaLimits, MediaPart, MediaPipeline, load_profile
from m3stack.gateway.multimodal.pipeline import warm_worker
from m3stack.gateway.multimodal.pool import WorkerPool
from m3stack.gateway.tokenize.tokenizer import ModelTokenizer
from m3stack.local.processes import ProcessGroup, free_port
from tests.helpers.hf_chat import hf_chat_greedy, load_hf_model

from .conftest import data_url, reference_decode_video
from .media_factory import encode_video

LOOPBACK = "127.0.0.1"
NUM_TOKENS = 8
QUESTION = "What happens in this clip?"
LONG_VIDEO_SECONDS = 180  # the e2e gateway's --media-max-video-seconds: the 3 min clip sits exactly at the limit
VIDEO_FPS = 2


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {
        "30s": encode_video(160, 96, 30 * VIDEO_FPS, VIDEO_FPS, seed=31),
        "3min": encode_video(160, 96, LONG_VIDEO_SECONDS * VIDEO_FPS, VIDEO_FPS, seed=32),
    }


@pytest.fixture(scope="module")
def processor(tiny_model_dir):
    return AutoProcessor.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return load_hf_model(tiny_model_dir)


def _hf_inputs(processor, data: bytes) -> dict:
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    video = reference_decode_video(data)
    return processor(
        text=[text],
        videos=[video.frames],
        video_metadata=[VideoMetadata(total_num_frames=video.total_num_frames, fps=video.fps)],
        videos_kwargs={"do_resize": True, "do_sample_frames": True},
        return_tensors="pt",
    )


def test_the_engine_embeds_a_multi_segment_video_as_transformers_does(tiny_model_dir, processor, hf_model, clips):
    """Gateway pipeline -> MultimodalItem -> the engine's own parsing and validation -> vision tower."""
    from m3stack.engine.assembly.build import build_engine_core
    from m3stack.engine.assembly.config import EngineConfig

    data = clips["30s"]
    tokenizer = ModelTokenizer.from_folder(tiny_model_dir)
    hf = _hf_inputs(processor, data)

    async def through_the_gateway():
        pool = WorkerPool(workers=1, warmup=warm_worker)
        await pool.start()
        pipeline = MediaPipeline(load_profile("minimax_m3_vl", tiny_model_dir), MediaLimits(), pool=pool)
        try:
            (item,) = await pipeline.process_media([MediaPart("video", data_url(data, "video/mp4"))])
        finally:
            await pipeline.close()
            await pool.close()
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        ids = tokenizer.encode(pipeline.expand_prompt(text, [item]), add_special_tokens=False)
        (spans,) = pipeline.placeholder_spans(ids, tokenizer, [item])
        (placed,) = pipeline.place([item], [spans])
        return ids, wire.multimodal_item(placed)

    ids, proto = asyncio.run(through_the_gateway())
    assert ids == hf["input_ids"][0].tolist()
    assert [[g.t, g.h, g.w] for g in proto.grids] == hf["video_grid_thw"].tolist() == [[4, 6, 12]] * 3 + [[3, 6, 12]]

    core = build_engine_core(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    request = build_request(
        core.info, "long-video", ids, SamplingParams(), mm_items=mm_items_from_proto([proto], 1 << 30)
    )
    (video,) = request.mm_inputs
    video_positions = (hf["input_ids"][0] == core.info.video_token_id).nonzero().flatten()
    assert torch.equal(video.embed_positions, video_positions)

    model = core.runner.model
    ours = model.encode_vision(video.pixel_values, torch.tensor(video.grids), "video")
    with torch.inference_mode():
        reference = hf_model.model.get_video_features(hf["pixel_values_videos"], hf["video_grid_thw"]).pooler_output
    torch.testing.assert_close(ours, torch.cat(reference), rtol=1e-4, atol=1e-5)
    # The segments matter: the same patches as one segment attend across all frames and embed differently.
    one_segment = model.encode_vision(video.pixel_values, torch.tensor([[15, 6, 12]]), "video")
    assert not torch.allclose(one_segment, ours, rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, tmp_path_factory):
    processes = ProcessGroup(tmp_path_factory.mktemp("long-video-logs"))
    engine_port, metrics_port, gateway_port = free_port(LOOPBACK), free_port(LOOPBACK), free_port(LOOPBACK)
    try:
        engine = processes.start(
            "engine",
            ["engine", "--model", str(tiny_model_dir), "--device", "cpu", "--host", LOOPBACK, "--port",
             str(engine_port), "--metrics-port", str(metrics_port), "--max-model-len", "4096", "--kv-cache-gb", "0.1"],
        )  # fmt: skip
        processes.wait_http_ok(engine, f"http://{LOOPBACK}:{metrics_port}/loaded", 300)
        gateway = processes.start(
            "gateway",
            ["gateway", "--model", str(tiny_model_dir), "--host", LOOPBACK, "--port", str(gateway_port),
             "--engines", f"{LOOPBACK}:{engine_port}", "--media-workers", "1",
             "--media-max-video-seconds", str(LONG_VIDEO_SECONDS)],
        )  # fmt: skip
        processes.wait_http_ok(gateway, f"http://{LOOPBACK}:{gateway_port}/ready", 180)
        yield openai.OpenAI(base_url=f"http://{LOOPBACK}:{gateway_port}/v1", api_key="none", max_retries=0, timeout=300)
    finally:
        processes.stop_all()


def _ask(client: openai.OpenAI, data: bytes):
    content = [
        {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}},
        {"type": "text", "text": QUESTION},
    ]
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=NUM_TOKENS,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )


@pytest.mark.parametrize("length", ["30s", "3min"])
def test_long_videos_through_the_api_generate_transformers_tokens(gateway, processor, hf_model, clips, length):
    response = _ask(gateway, clips[length])
    ours = [int(entry.token.removeprefix("token_id:")) for entry in response.choices[0].logprobs.content]
    video = reference_decode_video(clips[length])
    content = [{"type": "video"}, {"type": "text", "text": QUESTION}]
    expected, prompt_tokens = hf_chat_greedy(processor, hf_model, content, NUM_TOKENS, videos=[video])
    assert response.usage.prompt_tokens == prompt_tokens
    assert ours == expected


def test_a_video_one_frame_over_the_duration_limit_is_a_400_naming_it(gateway):
    # 56x56 keeps it cheap: the probe refuses it from the container's index, before decoding any pixel.
    over = encode_video(56, 56, LONG_VIDEO_SECONDS * VIDEO_FPS + 1, VIDEO_FPS, seed=33)
    with pytest.raises(openai.BadRequestError) as error:
        _ask(gateway, over)
    body = error.value.body
    assert error.value.status_code == 400 and body["code"] == "media_too_large"
    assert "--media-max-video-seconds" in body["message"] and "180.5 s" in body["message"]
    assert body["param"] == "messages[0].content[0]"
