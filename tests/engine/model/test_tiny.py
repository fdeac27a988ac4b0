"""The embedded tiny checkpoint: loadable by transformers, deterministic, shared safely, tokenizer complete."""

import hashlib
import os
import re
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoProcessor, AutoTokenizer, MiniMaxM3SparseForConditionalGeneration

from m3stack.cli import main
from m3stack.engine.model.config import load_config
from m3stack.engine.model.tiny import ensure_tiny_checkpoint, write_tiny_checkpoint
from m3stack.engine.model.tiny_tokenizer import IMAGE_END_TOKEN, IMAGE_START_TOKEN, IMAGE_TOKEN, SPECIAL_TOKENS


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_transformers_loads_every_tensor_of_the_tiny_checkpoint(tiny_model_dir):
    model, info = MiniMaxM3SparseForConditionalGeneration.from_pretrained(tiny_model_dir, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    text = model.config.text_config
    assert "full_attention" in text.layer_types and text.layer_types.count("minimax_m3_sparse") >= 2
    assert "dense" in text.mlp_layer_types and "sparse" in text.mlp_layer_types
    # Our config reader agrees with transformers on what it read.
    ours = load_config(tiny_model_dir)
    assert ours.text.rotary_dim == int(text.head_dim * text.rope_parameters["partial_rotary_factor"])
    assert ours.image_token_id == model.config.image_token_id and ours.video_token_id == model.config.video_token_id


def test_processor_expands_an_image_prompt_with_m3_markers(tiny_model_dir):
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "image", "image": Image.new("RGB", (90, 64))}, {"type": "text", "text": "Hi"}],
        },
    ]
    out = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    tokenizer = processor.tokenizer
    ids = list(out["input_ids"][0])
    grid = out["image_grid_thw"][0]
    expected = int(grid[0] * grid[1] * grid[2]) // 4
    assert ids.count(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)) == expected
    text = tokenizer.decode(ids)
    assert text.startswith("]~!b[]~b]system\n")
    assert "[e~[\n]~b]developer\nBe brief.[e~[\n]~b]user\n" + IMAGE_START_TOKEN in text
    assert text.endswith(IMAGE_END_TOKEN + "Hi[e~[\n]~b]ai\n")


def test_tokenizer_round_trips_any_text_and_keeps_special_tokens_whole(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "naïve 東京 🚀\t\n  ' spaces ' \x00 end"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)]
    assert tokenizer.bos_token == "]~!b[" and tokenizer.eos_token == "[e~["
    assert len(tokenizer) == load_config(tiny_model_dir).text.vocab_size


def test_generation_is_deterministic(tmp_path, tiny_model_dir):
    first = write_tiny_checkpoint(tmp_path / "a")
    assert _digest(first) == _digest(tiny_model_dir)


def test_concurrent_first_use_creates_one_complete_copy(tmp_path):
    # flock locks belong to open file descriptions, so two threads exclude each other as two processes do.
    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(ensure_tiny_checkpoint, [tmp_path] * 2))
    assert folders[0] == folders[1]
    created = [p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith(".")]
    assert created == [Path(folders[0]).name]
    assert (Path(folders[0]) / "model.safetensors.index.json").is_file()


def test_the_weightless_copy_is_made_without_torch_and_has_the_same_files(tmp_path, tiny_model_dir):
    # The gateway image has no torch: `init-tiny --no-weights` must not import it, and must write the very bytes
    # the engine image's whole model has, or gateway and engine pods would disagree on token ids.
    script = (
        "import sys; sys.modules['torch'] = None; sys.modules['safetensors.torch'] = None\n"
        "from m3stack.cli import main; sys.exit(main(['model', 'init-tiny', '--no-weights']))"
    )
    env = {**os.environ, "M3STACK_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert folder == tmp_path / "models" / tiny_model_dir.name
    whole = _digest(tiny_model_dir)
    weights = {name for name in whole if name.endswith(".safetensors") or name == "model.safetensors.index.json"}
    assert len(weights) == 3
    assert _digest(folder) == {name: digest for name, digest in whole.items() if name not in weights}


def test_the_cached_model_is_readable_by_other_users(tmp_path):
    # The images generate it as root and their pods read it as uid 10001; CI and developers may share a cache.
    folder = ensure_tiny_checkpoint(tmp_path)
    assert stat.S_IMODE(folder.stat().st_mode) & 0o005 == 0o005
    unreadable = [path.name for path in folder.iterdir() if not stat.S_IMODE(path.stat().st_mode) & 0o004]
    assert unreadable == []


def test_an_engine_refuses_the_weightless_copy(tmp_path):
    ensure_tiny_checkpoint(tmp_path, weights=False)
    with pytest.raises(ValueError, match="without its weights"):
        ensure_tiny_checkpoint(tmp_path)


def test_init_tiny_refuses_a_non_empty_folder(tmp_path, caplog):
    (tmp_path / "keep.txt").write_text("user data")
    assert main(["model", "init-tiny", str(tmp_path)]) == 2
    assert "not an empty folder" in caplog.text
    assert (tmp_path / "keep.txt").read_text() == "user data"


@pytest.mark.parametrize("missing", ["config.json"])
def test_load_config_names_a_missing_file(tmp_path, missing):
    with pytest.raises(ValueError, match=re.escape(missing)):
        load_config(tmp_path)


def test_inspect_summarizes_a_valid_checkpoint(tiny_model_dir, capsys):
    assert main(["model", "inspect", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    shards = sorted(tiny_model_dir.glob("*.safetensors"))
    stored = sum(len(load_file(shard)) for shard in shards)
    assert "1 dense attention, 3 MSA" in out and f"{stored} tensors in {len(shards)} file(s) match config.json" in out
