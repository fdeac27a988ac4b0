"""Prompt side: the expanded prompt and token ids equal MiniMaxM3VLProcessor's; placeholder spans are exact."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from m3stack.gateway.multimodal import MediaError, m3
from m3stack.gateway.multimodal import video as video_codec
from m3stack.gateway.multimodal.image import probe_image
from m3stack.gateway.multimodal.resize import ResizeBackend

from .conftest import data_url, m3_preprocessor, reference_decode_video
from .media_factory import encode_image, encode_video, natural_rgb

SPECIAL = [
    m3.M3PromptSpec.image_token,
    m3.M3PromptSpec.video_token,
    m3.M3PromptSpec.vision_start,
    m3.M3PromptSpec.vision_end,
]
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """Byte-level tokenizer (one token per byte) plus M3's vision special tokens."""
    alphabet = sorted(ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    return tok


@pytest.fixture(scope="module")
def media():
    images = [encode_image(natural_rgb(90, 130, 3), "PNG"), encode_image(natural_rgb(400, 300, 4), "JPEG")]
    video = encode_video(160, 96, 130, 30, seed=5)  # 4.3 s: at 4 fps, 17 frames -> 9 temporal patches, odd count
    return images, video


def test_expansion_equals_the_reference_processor(tokenizer, media):
    from transformers import PreTrainedTokenizerFast
    from transformers.models.minimax_m3_vl import (
        MiniMaxM3VLImageProcessor,
        MiniMaxM3VLProcessor,
        MiniMaxM3VLVideoProcessor,
    )
    from transformers.video_utils import VideoMetadata

    images, video = media
    text = "Look at ]<]image[>[ and ]<]video[>[, then ]<]image[>[."
    preprocessor = m3_preprocessor(ResizeBackend.TORCH, fps=4.0)
    spec = m3.M3PromptSpec(2, 2)
    image_plans = [preprocessor.plan_image(h.height, h.width) for h in map(probe_image, images)]
    probe = video_codec.probe_video(video, max_frame_pixels=10**7, max_frames=10**5)
    video_plan = preprocessor.plan_video(probe)
    expanded = spec.expand_text(
        text,
        [(p, preprocessor.tokens_for(p)) for p in image_plans],
        [(video_plan, preprocessor.tokens_for(video_plan))],
    )

    reference = MiniMaxM3VLProcessor(
        image_processor=MiniMaxM3VLImageProcessor(),
        tokenizer=PreTrainedTokenizerFast(tokenizer_object=tokenizer),
        video_processor=MiniMaxM3VLVideoProcessor(),
    )
    decoded = reference_decode_video(video)
    output = reference(
        text=[text],
        images=[data_url(images[0], "image/png"), data_url(images[1], "image/jpeg")],
        videos=[decoded.frames],
        video_metadata=[VideoMetadata(total_num_frames=decoded.total_num_frames, fps=decoded.fps)],
        videos_kwargs={"do_resize": True, "do_sample_frames": True, "fps": 4.0},
    )
    ids = tokenizer.encode(expanded).ids
    assert ids == output["input_ids"][0]
    grid_t = sum(t for t, _, _ in video_plan.grids)
    assert grid_t == 9 and expanded.count(" seconds[>[") == grid_t and "]<]0.0 seconds[>[" in expanded

    tokens = [preprocessor.tokens_for(p) for p in (image_plans[0], video_plan, image_plans[1])]
    spans = spec.placeholder_spans(ids, tokenizer, ["image", "video", "image"], tokens)
    image_id, video_id = tokenizer.token_to_id(spec.image_token), tokenizer.token_to_id(spec.video_token)
    ids_array = np.asarray(ids)
    for item_spans, wanted_id, count in zip(spans, (image_id, video_id, image_id), tokens, strict=True):
        positions = np.concatenate([np.arange(s.offset, s.offset + s.length) for s in item_spans])
        assert len(positions) == count and (ids_array[positions] == wanted_id).all()
    assert len(spans[1]) == sum(t for t, _, _ in video_plan.grids)  # one run per temporal patch
    covered = sum(s.length for item in spans for s in item)
    assert covered == int(np.isin(ids_array, [image_id, video_id]).sum())


def test_marker_count_must_match_items():
    preprocessor = m3_preprocessor(ResizeBackend.PILLOW)
    plan = preprocessor.plan_image(90, 130)
    spec = m3.M3PromptSpec(2, 2)
    with pytest.raises(MediaError, match="1 image placeholder"):
        spec.expand_text("one ]<]image[>[ only", [(plan, 1), (plan, 1)], [])


def test_spans_refuse_a_prompt_without_the_placeholders(tokenizer):
    spec = m3.M3PromptSpec(2, 2)
    ids = tokenizer.encode("no media here").ids
    with pytest.raises(MediaError, match="lacks the placeholders"):
        spec.placeholder_spans(ids, tokenizer, ["image"], [4])
