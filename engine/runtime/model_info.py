"""What the engine found in the model it serves (``ModelInfo``): what ``GetModelInfo`` reports and requests are
checked against.  Torch-free."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model that validation, scheduling and GetModelInfo need."""

    model_path: str
    served_model_name: str
    model_type: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    block_size: int
    image_token_id: int
    video_token_id: int
    patch_dim: int  # channels * temporal_patch * patch * patch of one flattened patch
    spatial_merge_size: int
    supports_vision: bool
    dtype: str
    device: str
    num_kv_blocks: int  # usable blocks (the reserved null block excluded)
