"""Create or check M3 checkpoints.

``m3stack model init-tiny [DIR]`` writes the tiny random-weight default model (its outputs are random tokens);
without DIR it fills the shared cache (``$M3STACK_CACHE/models/tiny-<version>``, what ``--model default`` uses)
and prints that folder; ``--no-weights`` leaves out the weights (no torch needed): the gateway image's copy.
``m3stack model inspect DIR`` validates a checkpoint against its config.json from the safetensors headers alone
(no weights are read) and summarizes the architecture.
"""

import argparse
import logging
import sys
from pathlib import Path

from m3stack.options import OptionGroup

logger = logging.getLogger(__name__)


def add_arguments(opts: OptionGroup) -> None:
    opts.parser.add_argument("action", choices=["init-tiny", "inspect"], help="what to do")
    opts.parser.add_argument(
        "path", nargs="?", default=None, help="checkpoint folder (init-tiny default: the shared cache)"
    )
    opts.parser.add_argument(
        "--no-weights",
        action="store_true",
        help="init-tiny: every file but the weights (tokenizer, chat template, configs: what a gateway reads)",
    )


def run(args: argparse.Namespace) -> int:
    if args.action == "inspect":
        return _inspect(args.path)
    from m3stack.engine.model.tiny import ensure_tiny_checkpoint, write_tiny_checkpoint

    weights = not args.no_weights
    if args.path is None:
        folder = ensure_tiny_checkpoint(weights=weights)
    else:
        folder = Path(args.path)
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            logger.error("%s exists and is not an empty folder; choose a new path", folder)
            return 2
        write_tiny_checkpoint(folder, weights=weights)
    logger.info(
        "tiny M3 checkpoint%s in %s",
        " with RANDOM weights (its outputs are random tokens)" if weights else ", no weights,",
        folder,
    )
    sys.stdout.write(f"{folder}\n")
    return 0


def _inspect(path: str | None) -> int:
    if path is None:
        logger.error("inspect needs a checkpoint folder")
        return 2
    from m3stack.engine.model.config import ConfigError, load_config
    from m3stack.engine.model.loader import CheckpointError, scan_checkpoint

    try:
        config = load_config(path)
        scan = scan_checkpoint(path, config)
    except (ConfigError, CheckpointError) as exc:
        logger.error("%s", exc)
        return 1
    text, vision = config.text, config.vision
    sparse, moe = sum(text.sparse_layers), sum(text.moe_layers)
    lines = [
        f"{path}: {text.num_layers} layers ({text.num_layers - sparse} dense attention, {sparse} MSA; "
        f"{text.num_layers - moe} dense MLP, {moe} MoE with {text.num_experts} experts top-{text.num_experts_per_tok})",
        f"  text: hidden {text.hidden_size}, heads {text.num_heads} q / {text.num_kv_heads} kv x {text.head_dim} "
        f"(rotary {text.rotary_dim}), vocab {text.vocab_size}",
        f"  MSA: block {text.index_block_size}, top-{text.index_topk_blocks} incl. {text.index_local_blocks} local, "
        f"index {text.index_num_heads} heads x {text.index_head_dim}",
        f"  vision: {vision.num_layers} layers, width {vision.hidden_size}, patch {vision.patch_size}, "
        f"merge {vision.spatial_merge_size}",
        f"  checkpoint: {scan.num_tensors} tensors in {len(scan.files)} file(s) match config.json",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
