"""End to end: the openai client sends an image as a data: URL, an image over http from 127.0.0.1 and a video;
the tiny model's greedy tokens through gateway + engine equal transformers' for the same prompt and weights."""

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from PIL import Image
from transformers import AutoProcessor

from m3stack.local.processes import ProcessGroup, free_port
from tests.helpers.hf_chat import hf_chat_greedy, load_hf_model

from .conftest import reference_decode_video
from .media_factory import encode_image, encode_video, natural_rgb

LOOPBACK = "127.0.0.1"
NUM_TOKENS = 12
QUESTION = "Compare the two pictures with the clip."


@pytest.fixture(scope="module")
def media():
    return {
        "png": encode_image(natural_rgb(70, 90, 21), "PNG"),
        "jpeg": encode_image(natural_rgb(100, 60, 22), "JPEG"),
        "mp4": encode_video(84, 56, 60, 20, seed=23),  # 3 s at 20 fps: 3 frames at 1 fps, padded to 2 patches
    }


@pytest.fixture(scope="module")
def image_server(media):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = media["jpeg"] if self.path == "/photo.jpg" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{LOOPBACK}:{server.server_port}/photo.jpg"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, tmp_path_factory):
    processes = ProcessGroup(tmp_path_factory.mktemp("e2e-logs"))
    engine_port, metrics_port, gateway_port = free_port(LOOPBACK), free_port(LOOPBACK), free_port(LOOPBACK)
    try:
        engine = processes.start(
            "engine",
            ["engine", "--model", str(tiny_model_dir), "--device", "cpu", "--host", LOOPBACK, "--port",
             str(engine_port), "--metrics-port", str(metrics_port), "--max-model-len", "512", "--kv-cache-gb", "0.05"],
        )  # fmt: skip
        processes.wait_http_ok(engine, f"http://{LOOPBACK}:{metrics_port}/loaded", 300)
        gateway = processes.start(
            "gateway",
            ["gateway", "--model", str(tiny_model_dir), "--host", LOOPBACK, "--port", str(gateway_port),
             "--engines", f"{LOOPBACK}:{engine_port}", "--media-workers", "1", "--media-allow-private-networks"],
        )  # fmt: skip
        processes.wait_http_ok(gateway, f"http://{LOOPBACK}:{gateway_port}/ready", 180)
        yield openai.OpenAI(base_url=f"http://{LOOPBACK}:{gateway_port}/v1", api_key="none", max_retries=0, timeout=300)
    finally:
        processes.stop_all()


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _transformers_tokens(tiny_model_dir, media) -> list[int]:
    content = [{"type": "image"}, {"type": "image"}, {"type": "video"}, {"type": "text", "text": QUESTION}]
    images = [Image.open(io.BytesIO(media[kind])).convert("RGB") for kind in ("png", "jpeg")]
    processor, model = AutoProcessor.from_pretrained(tiny_model_dir), load_hf_model(tiny_model_dir)
    tokens, _ = hf_chat_greedy(processor, model, content, NUM_TOKENS, images, [reference_decode_video(media["mp4"])])
    return tokens


def test_openai_client_with_images_and_video_matches_transformers(gateway, image_server, media, tiny_model_dir):
    content = [
        {"type": "image_url", "image_url": {"url": _data_url(media["png"], "image/png")}},
        {"type": "image_url", "image_url": {"url": image_server}},
        {"type": "video_url", "video_url": {"url": _data_url(media["mp4"], "video/mp4")}},
        {"type": "text", "text": QUESTION},
    ]
    response = gateway.chat.completions.create(
        model=gateway.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=NUM_TOKENS,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    ours = [int(entry.token.removeprefix("token_id:")) for entry in response.choices[0].logprobs.content]
    assert ours == _transformers_tokens(tiny_model_dir, media)


def test_unreachable_media_is_a_400(gateway):
    content = [{"type": "image_url", "image_url": {"url": f"http://{LOOPBACK}:{free_port(LOOPBACK)}/gone.png"}}]
    with pytest.raises(openai.BadRequestError) as error:
        gateway.chat.completions.create(
            model=gateway.models.list().data[0].id, messages=[{"role": "user", "content": content}], max_tokens=1
        )
    assert error.value.status_code == 400 and "connect" in str(error.value)
