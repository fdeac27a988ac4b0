"""MXFP8 scales are sharded with their weights under tensor and expert parallelism.

Every rank's FP8 parameters, dequantized with the scales it loaded, equal that rank's float parameters loaded from
the dequantized copy of the same checkpoint: the scales took exactly the rows and 32-input blocks of their weights.
"""

import pytest
import torch

from m3stack.engine.distributed.model import load_sharded_model
from m3stack.engine.distributed.sharding import ShardingError, plan_shards
from m3stack.engine.model import mxfp8
from m3stack.engine.model.config import load_config
from m3stack.engine.model.mxfp8_writer import write_dequantized_copy, write_mxfp8_copy
from m3stack.engine.model.quantization import SCALE_SUFFIX
from m3stack.engine.model.tiny import write_tiny_checkpoint

# Rows per rank that keep whole 32-input blocks at 2 ranks (the default tiny's 32-row experts would not).
WIDER = {"intermediate_size": 64, "shared_intermediate_size": 64}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp8-shards")
    quantized = write_mxfp8_copy(write_tiny_checkpoint(root / "float", WIDER), root / "mxfp8")
    return quantized, write_dequantized_copy(quantized, root / "dequantized")


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_dequantizes_to_its_float_shard(checkpoints, expert_parallel):
    quantized_dir, dequantized_dir = checkpoints
    text = load_config(quantized_dir).text
    checked = 0
    for rank in range(2):
        plan = plan_shards(text, 2, rank, expert_parallel)
        quantized, _ = load_sharded_model(quantized_dir, plan, "cpu", torch.float32)
        reference = dict(load_sharded_model(dequantized_dir, plan, "cpu", torch.float32)[0].named_parameters())
        params = dict(quantized.named_parameters())
        for name, param in params.items():
            if not mxfp8.is_quantized(param):
                continue
            scales = params[name + SCALE_SUFFIX]
            assert scales.stride(-2) == 1, f"rank {rank}: {name}'s scales are not block-major"
            weights = mxfp8.dequantize(param, scales)
            assert torch.equal(weights, reference[name]), f"rank {rank}: {name}"
            checked += 1
    # Per rank: 4 layers x (in_proj, o_proj) + dense gate_up/down + 3 MoE layers x (2 expert stacks + 2 shared).
    assert checked == 2 * (8 + 2 + 3 * 4)


def test_a_split_through_a_scale_block_is_refused_before_loading(tiny_model_dir, tmp_path):
    quantized_dir = write_mxfp8_copy(tiny_model_dir, tmp_path / "mxfp8")  # 32-row experts: 16 inputs a rank
    plan = plan_shards(load_config(quantized_dir).text, 2, 1, False)
    with pytest.raises(ShardingError, match=r"experts.0.w2.weight: this split gives a rank inputs 16:32.*blocks of 32"):
        load_sharded_model(quantized_dir, plan, "cpu", torch.float32)
