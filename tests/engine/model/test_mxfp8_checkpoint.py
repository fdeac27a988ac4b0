"""MXFP8 checkpoints: the writer's layout, the loader's checks, and the tiny model's MXFP8 copy against the float
model of its dequantized weights (ours) and against transformers loading the MXFP8 copy itself (its ``mxfp8``
quantizer, which on a CPU dequantizes at load; it needs ``accelerate``), float32 on CPU.
"""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import MiniMaxM3SparseForConditionalGeneration

from m3stack.engine.model import mxfp8
from m3stack.engine.model.config import load_config
from m3stack.engine.model.loader import CheckpointError, load_model, scan_checkpoint
from m3stack.engine.model.mxfp8_writer import RELEASE_IGNORED_LAYERS, write_dequantized_copy, write_mxfp8_copy
from tests.engine.model.hf_oracle import hf_greedy, relative_error
from tests.engine.model.paged_runner import Chunk, PagedRunner, Sequence

Q_PROJ = "language_model.model.layers.1.self_attn.q_proj.weight"
K_PROJ = "language_model.model.layers.1.self_attn.k_proj.weight"
EXPERT = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight"
EXPERT_GATE = "language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight"
ROUTER = "language_model.model.layers.2.block_sparse_moe.gate.weight"
LM_HEAD = "language_model.lm_head.weight"
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def mxfp8_dir(tiny_model_dir, tmp_path_factory):
    return write_mxfp8_copy(tiny_model_dir, tmp_path_factory.mktemp("mxfp8") / "tiny-mxfp8")


@pytest.fixture(scope="module")
def dequantized_dir(mxfp8_dir, tmp_path_factory):
    return write_dequantized_copy(mxfp8_dir, tmp_path_factory.mktemp("deq") / "tiny-dequantized")


def _tensors(folder) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118
                header = reader.get_slice(name)
                out[name] = (header.get_dtype(), header.get_shape())
    return out


def test_the_copy_has_the_release_layout(tiny_model_dir, mxfp8_dir) -> None:
    source, copy = _tensors(tiny_model_dir), _tensors(mxfp8_dir)
    quantized = {name for name, (dtype, _) in copy.items() if dtype == "F8_E4M3"}
    # Every linear of attention (incl. the MSA index projections), dense MLP, shared and routed experts.
    assert {n.split(".")[-2] for n in quantized} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "index_q_proj", "index_k_proj",
        "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
    }  # fmt: skip
    for name in quantized:
        assert copy[name + "_scale_inv"] == ("U8", [*source[name][1][:-1], source[name][1][-1] // 32])
    kept = set(source) - quantized
    assert all(copy[name] == source[name] for name in kept)  # embeddings, LM head, routers, norms, vision: as stored
    assert (
        ROUTER in kept and LM_HEAD in kept and not any(n.startswith(("vision_tower", "multi_modal")) for n in quantized)
    )
    assert set(copy) == set(source) | {n + "_scale_inv" for n in quantized}
    config = json.loads((mxfp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "mxfp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [1, 32],
        "ignored_layers": list(RELEASE_IGNORED_LAYERS),
    }
    index = json.loads((mxfp8_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(copy)
    assert index[EXPERT + "_scale_inv"] == index[EXPERT]
    for other in ("tokenizer.json", "chat_template.jinja", "preprocessor_config.json", "generation_config.json"):
        assert (mxfp8_dir / other).read_bytes() == (tiny_model_dir / other).read_bytes()


def test_the_weights_stay_fp8_in_the_model(mxfp8_dir) -> None:
    model, config = load_model(mxfp8_dir, "cpu", torch.float32)
    params = dict(model.named_parameters())
    assert params["layers.2.mlp.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert params["layers.2.mlp.gate_up_proj_scale_inv"].shape == (4, 64, 2)
    assert params["layers.1.attn.in_proj.weight"].dtype == torch.float8_e4m3fn
    assert params["layers.2.mlp.router.weight"].dtype == torch.float32
    assert params["lm_head.weight"].dtype == torch.float32
    # The loaded bytes are the file's bytes.
    stored = load_file(next(p for p in mxfp8_dir.glob("*.safetensors") if EXPERT in load_file(p)))
    assert torch.equal(params["layers.2.mlp.down_proj"][3].view(torch.uint8), stored[EXPERT].view(torch.uint8))
    assert torch.equal(params["layers.2.mlp.down_proj_scale_inv"][3], stored[EXPERT + "_scale_inv"])
    assert config.quantization is not None
    # In memory every scale tensor is block-major (a block's scales contiguous), as the kernels read them.
    scales = {name: p for name, p in params.items() if name.endswith("_scale_inv")}
    assert scales and all(p.stride(-2) == 1 for p in scales.values())


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 360, (150,), generator=torch.Generator().manual_seed(5))


def _greedy(model, prompt):
    with torch.inference_mode():
        return PagedRunner(model, 64, "cpu").greedy(Chunk(Sequence(), prompt, None, None), NUM_TOKENS)


@pytest.fixture(scope="module")
def mxfp8_greedy(mxfp8_dir, prompt):
    return _greedy(load_model(mxfp8_dir, "cpu", torch.float32)[0], prompt)


def test_mxfp8_model_equals_the_model_of_its_dequantized_weights(mxfp8_greedy, dequantized_dir, prompt) -> None:
    ours_logits, ours_tokens = mxfp8_greedy
    reference_logits, reference_tokens = _greedy(load_model(dequantized_dir, "cpu", torch.float32)[0], prompt)
    assert relative_error(ours_logits, reference_logits) <= 1e-6
    assert ours_tokens == reference_tokens


def test_mxfp8_model_matches_transformers_loading_the_mxfp8_copy(mxfp8_greedy, mxfp8_dir, prompt) -> None:
    """transformers reads the copy's layout (scale names and shapes, quantization_config) on its own."""
    ours_logits, ours_tokens = mxfp8_greedy
    oracle = MiniMaxM3SparseForConditionalGeneration.from_pretrained(mxfp8_dir, dtype=torch.float32).eval()
    hf_logits, hf_tokens = hf_greedy(oracle, prompt, NUM_TOKENS)
    assert relative_error(ours_logits, hf_logits) <= 1e-4
    assert ours_tokens == hf_tokens


def test_quantization_changes_the_model_by_e4m3_rounding(tiny_model_dir, mxfp8_greedy, prompt) -> None:
    """The comparisons above could not pass by loading the float weights: the MXFP8 model's logits differ, by what
    3-bit mantissas do to this fragile random model (mean |delta| 15% of the logits' RMS, 72% of the prompt's
    argmaxes kept, measured), not by what a wrong exponent would (a factor of 2 on a block)."""
    float_logits, _ = _greedy(load_model(tiny_model_dir, "cpu", torch.float32)[0], prompt)
    mxfp8_logits, _ = mxfp8_greedy
    delta = (mxfp8_logits - float_logits).abs().mean() / float_logits.pow(2).mean().sqrt()
    assert 0.01 < delta < 0.3
    assert (mxfp8_logits.argmax(-1) == float_logits.argmax(-1)).float().mean() > 0.5


def _edit(folder, edit) -> None:
    for shard in sorted(folder.glob("model-*.safetensors")):
        tensors = load_file(shard)
        edit(tensors)
        save_file(tensors, shard, metadata={"format": "pt"})


def _config_edit(folder, edit) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


@pytest.fixture
def copy(mxfp8_dir, tmp_path):
    return shutil.copytree(mxfp8_dir, tmp_path / "copy")


def _scan_error(folder) -> str:
    with pytest.raises(CheckpointError) as error:
        scan_checkpoint(folder, load_config(folder))
    return str(error.value)


def test_an_fp8_tensor_the_config_ignores_is_refused(copy) -> None:
    _config_edit(copy, lambda raw: raw["quantization_config"]["ignored_layers"].append("model.layers.1.self_attn"))
    assert f"{Q_PROJ} is F8_E4M3 but quantization_config.ignored_layers keeps it" in _scan_error(copy)


def test_missing_or_misshaped_scales_are_refused(copy) -> None:
    def edit(tensors):
        tensors.pop(Q_PROJ + "_scale_inv", None)
        if EXPERT_GATE + "_scale_inv" in tensors:
            tensors[EXPERT_GATE + "_scale_inv"] = tensors[EXPERT_GATE + "_scale_inv"][:, :1].clone()

    _edit(copy, edit)
    message = _scan_error(copy)
    assert f"{Q_PROJ} is F8_E4M3 without its scale {Q_PROJ}_scale_inv" in message
    assert f"{EXPERT_GATE}_scale_inv is U8 [32, 1], expected U8 [32, 2]" in message


def test_fp8_where_the_model_serves_full_precision_is_refused(copy) -> None:
    def edit(tensors):
        if ROUTER in tensors:
            values, scales = mxfp8.quantize(tensors[ROUTER])
            tensors[ROUTER], tensors[ROUTER + "_scale_inv"] = values, scales

    _edit(copy, edit)
    assert f"{ROUTER} is F8_E4M3; embeddings, the LM head, routers" in _scan_error(copy)


def test_a_fused_projection_must_be_one_format(copy) -> None:
    def edit(tensors):
        if K_PROJ in tensors:
            tensors[K_PROJ] = mxfp8.dequantize(tensors[K_PROJ], tensors.pop(K_PROJ + "_scale_inv"))

    _edit(copy, edit)
    assert "mixed-format tensor(s): layers.1.attn.in_proj.weight (from ['F8_E4M3', 'float'])" in _scan_error(copy)


def test_stray_scales_and_unconfigured_fp8_are_refused(copy, tiny_model_dir) -> None:
    def edit(tensors):
        if LM_HEAD in tensors:
            tensors[LM_HEAD + "_scale_inv"] = torch.zeros(1, dtype=torch.uint8)

    _edit(copy, edit)
    assert f"1 unexpected tensor(s): {LM_HEAD}_scale_inv" in _scan_error(copy)
    _config_edit(copy, lambda raw: raw.pop("quantization_config"))
    assert "is F8_E4M3 but config.json has no quantization_config" in _scan_error(copy)
