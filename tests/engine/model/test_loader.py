"""Checkpoint loading: sharded or single-file, dtype conversion, and complete, early errors for bad tensors."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from m3stack.cli import main
from m3stack.engine.model.loader import CheckpointError, load_model

EMBED = "language_model.model.embed_tokens.weight"
LM_HEAD = "language_model.lm_head.weight"
EXPERT = "language_model.model.layers.2.block_sparse_moe.experts.1.w3.weight"


@pytest.fixture
def checkpoint(tiny_model_dir, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, folder)
    return folder


def _shards(folder) -> list:
    return sorted(folder.glob("model-*.safetensors"))


def _edit(folder, edit) -> None:
    """Rewrite every shard through ``edit(name -> tensor dict)`` (the index keeps naming the same files)."""
    for shard in _shards(folder):
        tensors = load_file(shard)
        edit(tensors)
        save_file(tensors, shard, metadata={"format": "pt"})


def test_every_problem_is_reported_at_once_before_loading(checkpoint):
    def break_it(tensors):
        tensors.pop(EXPERT, None)
        if EMBED in tensors:
            tensors[EMBED] = tensors[EMBED][:-1].clone()
            tensors["language_model.model.layers.0.self_attn.rogue.weight"] = torch.zeros(2)

    _edit(checkpoint, break_it)
    with pytest.raises(CheckpointError) as error:
        load_model(checkpoint)
    message = str(error.value)
    assert f"1 missing tensor(s): {EXPERT}" in message
    assert "1 unexpected tensor(s): language_model.model.layers.0.self_attn.rogue.weight" in message
    assert re.search(rf"1 mis-shaped tensor\(s\): {re.escape(EMBED)} is \[\d+, 64\], expected \[\d+, 64\]", message)


def test_non_float_tensors_are_refused(checkpoint):
    _edit(checkpoint, lambda t: t.update({k: v.to(torch.int32) for k, v in t.items() if k == LM_HEAD}))
    with pytest.raises(CheckpointError, match=f"non-float tensor\\(s\\): {re.escape(LM_HEAD)} is I32"):
        load_model(checkpoint)


def test_index_naming_a_missing_shard_is_an_error(checkpoint):
    _shards(checkpoint)[-1].unlink()
    with pytest.raises(CheckpointError, match=re.escape("do not exist: model-00002-of-00002.safetensors")):
        load_model(checkpoint)


def test_single_file_checkpoint_with_extra_mtp_tensors_loads_the_same_weights(checkpoint, tiny_model_dir):
    merged = {}
    for shard in _shards(checkpoint):
        merged.update(load_file(shard))
        shard.unlink()
    (checkpoint / "model.safetensors.index.json").unlink()
    merged["mtp.layers.0.weight"] = torch.zeros(3)  # multi-token-prediction heads are not served
    save_file(merged, checkpoint / "model.safetensors", metadata={"format": "pt"})
    single, _ = load_model(checkpoint)
    sharded, _ = load_model(tiny_model_dir)
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_loads_into_the_requested_dtype(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, "cpu", torch.bfloat16)
    stored = load_file(next(p for p in _shards(tiny_model_dir) if EMBED in load_file(p)))[EMBED]
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(model.embed_tokens.weight, stored.to(torch.bfloat16))
    assert model.layers[1].mlp.router.correction_bias.dtype == torch.float32  # kept exact for routing


def test_tied_embeddings_need_no_lm_head(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (checkpoint / "config.json").write_text(json.dumps(config))
    _edit(checkpoint, lambda t: t.pop(LM_HEAD, None))
    model, _ = load_model(checkpoint)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_unreadable_shard_is_named(checkpoint):
    broken = _shards(checkpoint)[0]
    broken.write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match=f"{re.escape(broken.name)}: not a readable safetensors file"):
        load_model(checkpoint)


def test_inspect_reports_a_broken_checkpoint(checkpoint, caplog):
    _edit(checkpoint, lambda t: t.pop(EXPERT, None))
    assert main(["model", "inspect", str(checkpoint)]) == 1
    assert f"1 missing tensor(s): {EXPERT}" in caplog.text
