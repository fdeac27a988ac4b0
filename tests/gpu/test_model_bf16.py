"""The serving model on the GPU against transformers' M3 on the same GPU, tiny checkpoint, text + image + video.

float32 (TF32 off): the CPU suite's bar, prompt logits within 1e-4 relative error and 32 identical greedy tokens.
bfloat16: per-token prompt-logit errors against the float32 oracle distributed like those of transformers' own
bfloat16 model (median and 90th percentile within 1.5x), and greedy tokens, decoded step by step through the
paged cache, that the float32 oracle agrees with as often as with transformers' bfloat16 greedy tokens.

Inputs are synthetic (random normalized patches, placeholder rows at known places), so neither the HF processors
nor torchvision are needed on the GPU machine; transformers >= 5.24 is (the .whl folder carries it).

The 1e-4 bar only means something when no discrete decision of the forward (an MSA block top-k, an MoE expert
top-k, a greedy argmax) sits within rounding of a tie: with seed 11 the image prompt's row 193 had two MSA
candidate blocks 1e-6 apart on layer 1, so transformers and ours, both correct float32 on CUDA, picked different
blocks and that row's logits differed by 2.6% (the H200 run's failure; float64 on CPU showed the same gap).
``test_prompts_are_well_conditioned`` checks that on the CPU, float32 against float64, before the GPU is blamed.
"""

import pytest
import torch
from transformers import MiniMaxM3SparseForConditionalGeneration

from m3stack.engine.model.loader import load_model
from m3stack.engine.model.tiny import ensure_tiny_checkpoint
from m3stack.engine.model.vision import Modality
from tests.engine.model.hf_oracle import hf_greedy, oracle_agreement, relative_error, token_errors
from tests.engine.model.paged_runner import Chunk, PagedRunner, Sequence

NUM_TOKENS = 32
NUM_PAGES = 128
DEVICE = "cuda"
# (modality, grid_thw rows) per case; None = text only.  The video is one 6-frame-patch clip in chunks of 4 + 2.
BACKENDS = ["reference", "gpu"]
# Seed 12 leaves every decision of every case clear of ties (see the module docstring); 11 did not for the image.
PROMPT_SEED = 12
CASES = {"text": None, "image": (Modality.IMAGE, [[1, 16, 20]]), "video": (Modality.VIDEO, [[4, 4, 6], [2, 4, 6]])}


@pytest.fixture(scope="module", autouse=True)
def exact_float32():
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@pytest.fixture(scope="module")
def checkpoint():
    return ensure_tiny_checkpoint()


def _oracle(checkpoint, dtype):
    return MiniMaxM3SparseForConditionalGeneration.from_pretrained(checkpoint, dtype=dtype).to(DEVICE).eval()


@pytest.fixture(scope="module")
def prompts(checkpoint):
    """Per case: input ids with placeholder runs, and the patches + grid the placeholders stand for."""
    config = load_model(checkpoint, "cpu", torch.float32)[1]
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    out = {}
    for name, media in CASES.items():
        text = torch.randint(0, 360, (180,), generator=generator)
        if media is None:
            out[name] = (text, None)
            continue
        modality, grid = media
        grid_thw = torch.tensor(grid)
        num_tokens = int(grid_thw.prod(-1).sum()) // config.merge_unit
        token = config.image_token_id if modality == Modality.IMAGE else config.video_token_id
        ids = torch.cat([text[:40], torch.full((num_tokens,), token), text[40:]])
        patches = torch.randn((int(grid_thw.prod(-1).sum()), config.vision.patch_dim), generator=generator)
        out[name] = (ids, (modality, patches, grid_thw))
    return out


def _hf_kwargs(media, dtype) -> dict:
    if media is None:
        return {}
    modality, patches, grid = media
    if modality == Modality.IMAGE:
        return {"pixel_values": patches.to(DEVICE, dtype), "image_grid_thw": grid.to(DEVICE)}
    return {"pixel_values_videos": patches.to(DEVICE, dtype), "video_grid_thw": grid.to(DEVICE)}


def _backend_factory(name: str, model):
    """``reference``: plain PyTorch; ``gpu``: the Triton MSA kernels + FlashInfer (engine.attention.gpu)."""
    if name == "reference":
        return None
    from m3stack.engine.attention.gpu import GpuAttentionBackend

    text = model.config.text
    return lambda caches: GpuAttentionBackend(
        caches, topk_blocks=text.index_topk_blocks, local_blocks=text.index_local_blocks, num_q_heads=text.num_heads
    )


def _ours(model, ids, media, backend: str, device: str = DEVICE) -> tuple[torch.Tensor, list[int]]:
    rows = embeds = None
    if media is not None:
        modality, patches, grid = media
        with torch.inference_mode():
            embeds = model.encode_vision(patches.to(device), grid, modality)
        token = model.config.image_token_id if modality == Modality.IMAGE else model.config.video_token_id
        rows = torch.nonzero(ids == token).flatten().to(device)
    runner = PagedRunner(model, NUM_PAGES, device, backend_factory=_backend_factory(backend, model))
    with torch.inference_mode():
        return runner.greedy(Chunk(Sequence(), ids, rows, embeds), NUM_TOKENS)


@pytest.fixture(scope="module")
def float32_reference(checkpoint, prompts):
    oracle = _oracle(checkpoint, torch.float32)
    results = {
        name: hf_greedy(oracle, ids.to(DEVICE), NUM_TOKENS, **_hf_kwargs(media, torch.float32))
        for name, (ids, media) in prompts.items()
    }
    return oracle, results


@pytest.mark.parametrize("name", list(CASES))
def test_prompts_are_well_conditioned(checkpoint, prompts, name):
    """Float32 and float64 on the CPU agree to 1e-5 with the same greedy tokens: no decision sits on a tie, so
    two correct float32 implementations on the GPU must agree to the 1e-4 bar below."""
    ids, media = prompts[name]
    (logits32, tokens32), (logits64, tokens64) = (
        _ours(load_model(checkpoint, "cpu", dtype)[0], ids, media, "reference", "cpu")
        for dtype in (torch.float32, torch.float64)
    )
    assert relative_error(logits32, logits64) <= 1e-5
    assert tokens32 == tokens64


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_float32_on_gpu_matches_transformers(checkpoint, prompts, float32_reference, name, backend):
    model, _ = load_model(checkpoint, DEVICE, torch.float32)
    ids, media = prompts[name]
    logits, tokens = _ours(model, ids, media, backend)
    reference_logits, reference_tokens = float32_reference[1][name]
    assert relative_error(logits, reference_logits) <= 1e-4
    assert tokens == reference_tokens


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_bfloat16_is_as_accurate_as_transformers_bfloat16(checkpoint, prompts, float32_reference, name, backend):
    oracle32, results32 = float32_reference
    ids, media = prompts[name]
    reference_logits = results32[name][0]
    device_ids = ids.to(DEVICE)
    hf16 = _oracle(checkpoint, torch.bfloat16)
    hf16_logits, hf16_tokens = hf_greedy(hf16, device_ids, NUM_TOKENS, **_hf_kwargs(media, torch.bfloat16))
    model, _ = load_model(checkpoint, DEVICE, torch.bfloat16)
    logits, tokens = _ours(model, ids, media, backend)

    # The tiny random model is fragile in bf16 (a near-tie flips an MoE route or an MSA block and that token's
    # logits move a lot), so compare error distributions with transformers' own bf16 run, not single maxima.
    ours_errors, hf_errors = token_errors(logits, reference_logits), token_errors(hf16_logits, reference_logits)
    for quantile in (0.5, 0.9):
        assert torch.quantile(ours_errors, quantile) <= 1.5 * torch.quantile(hf_errors, quantile) + 5e-3

    # Greedy decoding through the paged cache agrees with the float32 oracle as often as transformers' bf16 does.
    fp32_kwargs = _hf_kwargs(media, torch.float32)
    ours_agreement = oracle_agreement(oracle32, device_ids, tokens, **fp32_kwargs)
    hf_agreement = oracle_agreement(oracle32, device_ids, hf16_tokens, **fp32_kwargs)
    assert ours_agreement >= hf_agreement - 3 / NUM_TOKENS
