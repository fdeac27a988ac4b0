"""The local stack end to end through the official ``openai`` client: text, image and video chat turns,
streamed and not, give transformers' greedy tokens for the same prompt and weights; a corrupt video among
good requests is a 400 and changes nothing for the others."""

import base64
import concurrent.futures
import io
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from PIL import Image
from transformers import AutoProcessor

from tests.gateway.multimodal.conftest import reference_decode_video
from tests.gateway.multimodal.media_factory import encode_image, encode_video, natural_rgb
from tests.helpers.hf_chat import hf_chat_greedy, load_hf_model

pytestmark = pytest.mark.xdist_group("e2e")

NUM_TOKENS = 8
QUESTION = "What do you see?"
GREEDY = {"temperature": 0, "max_tokens": NUM_TOKENS, "logprobs": True}
TOKEN_IDS = {"ignore_eos": True, "return_tokens_as_token_ids": True}


def data_url(payload: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


@dataclass(frozen=True)
class Turn:
    """One user turn as the API gets it, and as transformers' processor gets it."""

    api_content: list[dict[str, Any]]
    hf_content: list[dict[str, Any]]
    images: tuple[Image.Image, ...] = ()
    video: bytes | None = None


@pytest.fixture(scope="module")
def turns() -> dict[str, Turn]:
    png = encode_image(natural_rgb(60, 80, seed=31), "PNG")
    mp4 = encode_video(84, 56, 60, 20, seed=32)  # 3 s at 20 fps: sampled at 1 fps by the gateway and HF alike
    question = {"type": "text", "text": QUESTION}
    return {
        "text": Turn([question], [question]),
        "image": Turn(
            [{"type": "image_url", "image_url": {"url": data_url(png, "image/png")}}, question],
            [{"type": "image"}, question],
            images=(Image.open(io.BytesIO(png)).convert("RGB"),),
        ),
        "video": Turn(
            [{"type": "video_url", "video_url": {"url": data_url(mp4, "video/mp4")}}, question],
            [{"type": "video"}, question],
            video=mp4,
        ),
    }


@pytest.fixture(scope="module")
def reference(tiny_model_dir, turns):
    """transformers' (greedy ids, prompt length) per turn kind, computed on first use."""
    processor, model = AutoProcessor.from_pretrained(tiny_model_dir), load_hf_model(tiny_model_dir)
    cache: dict[str, tuple[list[int], int]] = {}

    def get(kind: str) -> tuple[list[int], int]:
        if kind not in cache:
            turn = turns[kind]
            videos = [reference_decode_video(turn.video)] if turn.video else []
            cache[kind] = hf_chat_greedy(processor, model, turn.hf_content, NUM_TOKENS, turn.images, videos)
        return cache[kind]

    return get


def token_ids(logprobs_content) -> list[int]:
    """Chat logprobs entries named ``token_id:N`` -> the ids."""
    return ids_of([entry.token for entry in logprobs_content or ()])


def ids_of(tokens: list[str]) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in tokens]


def chat(client: openai.OpenAI, model: str, content: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    """ids, text, usage and finish reason of one greedy chat turn, streamed or not."""
    messages = [{"role": "user", "content": content}]
    if not stream:
        response = client.chat.completions.create(model=model, messages=messages, extra_body=TOKEN_IDS, **GREEDY)
        choice = response.choices[0]
        return {
            "ids": token_ids(choice.logprobs.content),
            "text": choice.message.content,
            "usage": response.usage,
            "finish_reason": choice.finish_reason,
        }
    chunks = client.chat.completions.create(
        model=model,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=TOKEN_IDS,
        **GREEDY,
    )
    result: dict[str, Any] = {"ids": [], "text": "", "usage": None, "finish_reason": None, "chunks": 0}
    for chunk in chunks:
        result["chunks"] += 1
        result["usage"] = chunk.usage or result["usage"]
        for choice in chunk.choices:
            result["ids"] += token_ids(choice.logprobs.content if choice.logprobs else None)
            result["text"] += choice.delta.content or ""
            result["finish_reason"] = choice.finish_reason or result["finish_reason"]
    return result


def test_models_lists_the_served_model(client, model_name, tiny_model_dir):
    assert [model.id for model in client.models.list().data] == [model_name] == [tiny_model_dir.name]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["text", "image", "video"])
def test_chat_turn_gives_transformers_greedy_tokens(client, model_name, turns, reference, hf_tokenizer, kind, stream):
    result = chat(client, model_name, turns[kind].api_content, stream)
    expected_ids, prompt_tokens = reference(kind)
    assert result["ids"] == expected_ids
    assert result["text"] == hf_tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert result["usage"].prompt_tokens == prompt_tokens
    assert result["usage"].completion_tokens == NUM_TOKENS
    assert result["finish_reason"] == "length"
    if stream:
        assert result["chunks"] > NUM_TOKENS // 2, "the answer came as a stream, not as one chunk"


def test_completions_streamed_equal_whole(client, model_name, hf_tokenizer):
    request = {"model": model_name, "prompt": "The local stack", "max_tokens": NUM_TOKENS, "temperature": 0}
    request |= {"logprobs": 0, "extra_body": TOKEN_IDS}
    whole = client.completions.create(**request)
    ids = ids_of(whole.choices[0].logprobs.tokens)
    streamed_ids, streamed_text = [], ""
    for chunk in client.completions.create(stream=True, **request):
        for choice in chunk.choices:
            streamed_text += choice.text
            streamed_ids += [
                int(t.removeprefix("token_id:")) for t in (choice.logprobs.tokens if choice.logprobs else [])
            ]
    assert len(ids) == whole.usage.completion_tokens == NUM_TOKENS
    assert streamed_ids == ids
    assert streamed_text == whole.choices[0].text == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_corrupt_video_is_a_400_and_the_requests_beside_it_are_unaffected(client, model_name, turns, reference):
    good = turns["video"].video
    corrupt = {
        "truncated": good[: len(good) // 3],
        "garbage": bytes(range(256)) * 64,
        "zeroed_frames": good[:64] + bytes(len(good) - 64),
    }
    question = {"type": "text", "text": QUESTION}
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        good_futures = {
            pool.submit(chat, client, model_name, turns[kind].api_content, stream): kind
            for kind, stream in [("text", True), ("image", False), ("video", True), ("text", False), ("image", True)]
        }
        bad_futures = {
            pool.submit(
                chat,
                client,
                model_name,
                [{"type": "video_url", "video_url": {"url": data_url(payload, "video/mp4")}}, question],
                False,
            ): name
            for name, payload in corrupt.items()
        }
        for future, name in bad_futures.items():
            with pytest.raises(openai.BadRequestError) as error:
                future.result()
            assert error.value.status_code == 400, name
            assert "video" in str(error.value).lower(), (name, str(error.value))
        for future, kind in good_futures.items():
            assert future.result()["ids"] == reference(kind)[0], kind
    # The media workers are still healthy: the same good video again.
    assert chat(client, model_name, turns["video"].api_content, True)["ids"] == reference("video")[0]
