"""The serving model against transformers' M3 (the oracle), float32 on CPU, same tiny checkpoint.

For a text, an image and a video prompt, each spanning many 16-token MSA blocks (top-4 selection, so most blocks
are skipped): prompt logits within 1e-4 relative error and 32 greedy tokens identical.  Ours runs through the
paged reference backend on shuffled, NaN-poisoned pages, with the prompt prefilled whole or in chunks.
"""

import logging

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, MiniMaxM3SparseForConditionalGeneration

from m3stack.engine.model.loader import load_model
from m3stack.engine.model.vision import Modality
from tests.engine.model.hf_oracle import hf_greedy, relative_error
from tests.engine.model.paged_runner import Chunk, PagedRunner, Sequence

logger = logging.getLogger(__name__)

NUM_TOKENS = 32
MAX_RELATIVE_ERROR = 1e-4
NUM_PAGES = 64


@pytest.fixture(scope="module")
def ours(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, "cpu", torch.float32)
    return model


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    return MiniMaxM3SparseForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(tiny_model_dir):
    return AutoProcessor.from_pretrained(tiny_model_dir)


def _prompt_text(processor, part: dict, words: int, rng: np.random.Generator) -> str:
    """A chat prompt with one media part and enough random text that the prompt spans many blocks."""
    vocabulary = ["serving", "sparse", "block", "token", "image", "video", "frame", "model", "cache", "page"]
    question = " ".join(rng.choice(vocabulary, size=words))
    messages = [{"role": "user", "content": [part, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def text_case(ours):
    ids = torch.randint(0, 360, (203,), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "ours_mm": (None, None), "hf_mm": {}}


@pytest.fixture(scope="module")
def image_case(ours, processor):
    rng = np.random.default_rng(2)
    image = Image.fromarray(rng.integers(0, 256, (224, 280, 3), dtype=np.uint8))
    text = _prompt_text(processor, {"type": "image"}, 60, rng)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    # The engine receives uint8 patches and normalizes them itself (the gateway's compact wire format).
    raw = processor.image_processor(images=[image], do_rescale=False, do_normalize=False, return_tensors="pt")
    assert raw["pixel_values"].dtype == torch.uint8
    return _media_case(ours, inputs, raw["pixel_values"], inputs["image_grid_thw"], Modality.IMAGE, "image")


@pytest.fixture(scope="module")
def video_case(ours, processor):
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, (12, 56, 84, 3), dtype=np.uint8)  # 6 temporal patches -> chunks of 4 + 2
    text = _prompt_text(processor, {"type": "video"}, 50, rng)
    inputs = processor(text=[text], videos=[frames], return_tensors="pt")
    assert inputs["video_grid_thw"].shape[0] == 2
    return _media_case(
        ours, inputs, inputs["pixel_values_videos"], inputs["video_grid_thw"], Modality.VIDEO, "pixel_values_videos"
    )


def _media_case(ours, inputs, patches, grid_thw, modality, kind) -> dict:
    ids = inputs["input_ids"][0]
    token_id = ours.config.image_token_id if modality == Modality.IMAGE else ours.config.video_token_id
    with torch.inference_mode():
        embeds = ours.encode_vision(patches, grid_thw, modality)
    rows = torch.nonzero(ids == token_id).flatten()
    assert rows.numel() == embeds.shape[0] > 0
    if kind == "image":
        hf_mm = {"pixel_values": inputs["pixel_values"], "image_grid_thw": grid_thw}
    else:
        hf_mm = {"pixel_values_videos": patches, "video_grid_thw": grid_thw}
    return {"input_ids": ids, "ours_mm": (rows, embeds), "hf_mm": hf_mm}


@pytest.fixture(scope="module")
def oracle_results(oracle, text_case, image_case, video_case):
    cases = {"text": text_case, "image": image_case, "video": video_case}
    return {name: hf_greedy(oracle, case["input_ids"], NUM_TOKENS, **case["hf_mm"]) for name, case in cases.items()}


def _run_ours(model, case, prefill_chunk=None):
    rows, embeds = case["ours_mm"]
    runner = PagedRunner(model, NUM_PAGES, "cpu")
    with torch.inference_mode():
        return runner.greedy(Chunk(Sequence(), case["input_ids"], rows, embeds), NUM_TOKENS, prefill_chunk)


@pytest.mark.parametrize("name", ["text", "image", "video"])
@pytest.mark.parametrize("prefill_chunk", [None, 45])
def test_logits_and_greedy_tokens_match_transformers(
    ours, oracle_results, text_case, image_case, video_case, name, prefill_chunk
):
    case = {"text": text_case, "image": image_case, "video": video_case}[name]
    text = ours.config.text
    # Each query sees at most top-k blocks: the prompt is over twice that, so most blocks are skipped.
    assert case["input_ids"].shape[0] > 2 * text.index_block_size * text.index_topk_blocks
    logits, tokens = _run_ours(ours, case, prefill_chunk)
    reference_logits, reference_tokens = oracle_results[name]
    error = relative_error(logits, reference_logits)
    logger.info("%s prompt of %d tokens: max relative logit error %.2e", name, case["input_ids"].shape[0], error)
    assert error <= MAX_RELATIVE_ERROR
    assert tokens == reference_tokens


def test_block_selection_matters_at_these_lengths(ours, oracle_results, text_case):
    """Dense attention on the MSA layers would fail the comparison: the sparse path is what is being tested."""
    runner = PagedRunner(ours, NUM_PAGES, "cpu", topk_blocks=10_000)
    with torch.inference_mode():
        logits = runner.prefill(Chunk(Sequence(), text_case["input_ids"]))
    assert relative_error(logits, oracle_results["text"][0]) > 100 * MAX_RELATIVE_ERROR


def test_a_mixed_batch_step_equals_separate_runs(ours, text_case, image_case):
    """One step holding a prefill chunk of one request and a decode token of another (the varlen layout)."""
    text_ids = text_case["input_ids"]
    rows, embeds = image_case["ours_mm"]
    image_ids = image_case["input_ids"]
    with torch.inference_mode():
        alone = PagedRunner(ours, NUM_PAGES, "cpu", seed=1)
        decoding = Sequence()
        alone.step([Chunk(decoding, text_ids[:-1])])
        expected_decode = alone.step([Chunk(decoding, text_ids[-1:])])
        expected_prefill = alone.step([Chunk(Sequence(), image_ids, rows, embeds)])

        batched = PagedRunner(ours, NUM_PAGES, "cpu", seed=2)
        decoding = Sequence()
        batched.step([Chunk(decoding, text_ids[:-1])])
        both = batched.step([Chunk(Sequence(), image_ids, rows, embeds), Chunk(decoding, text_ids[-1:])])
    assert relative_error(both[:-1], expected_prefill) <= MAX_RELATIVE_ERROR
    assert relative_error(both[-1:], expected_decode) <= MAX_RELATIVE_ERROR
