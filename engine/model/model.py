"""The M3 model for serving: flat varlen batches over a paged KV cache.

The runtime calls, per engine step::

    model = M3ForServing(config, dtype, device)           # or loader.load_model(path, device, dtype)
    embeds = model.encode_vision(pixel_values, grid_thw, Modality.IMAGE)   # [num_tokens, hidden], once per item
    hidden = model.forward(input_ids, positions, backend, mm_positions, mm_embeds)  # [T, hidden]
    logits = model.compute_logits(hidden[logits_indices])  # float32 [n, vocab]

``input_ids`` / ``positions`` are ``[T]`` int64 for all new tokens of all requests of the step (no batch dim);
``backend`` is an ``engine.attention`` backend on which ``begin_step(metadata)`` was called for this step.
``mm_positions`` ``[N]`` are rows of this step whose input embedding is replaced by ``mm_embeds`` ``[N, hidden]``
(the image/video placeholder tokens, as transformers' ``masked_scatter``).  ``kv_cache_spec(dtype)`` describes
the cache the backend needs: one page = one MSA block of ``index_block_size`` tokens.
"""

from collections.abc import Collection

import torch
from torch import nn

from m3stack.engine.attention.backend import AttentionBackend
from m3stack.engine.kv_cache.tensors import KVCacheSpec
from m3stack.engine.model.attention import Attention
from m3stack.engine.model.config import M3Config, TextConfig
from m3stack.engine.model.mlp import GatedMLP
from m3stack.engine.model.moe import MoE
from m3stack.engine.model.mxfp8 import quantize_parameters
from m3stack.engine.model.norm import GemmaRMSNorm
from m3stack.engine.model.params import Embedding, Linear
from m3stack.engine.model.projector import Projector
from m3stack.engine.model.rope import inverse_frequencies, text_cos_sin
from m3stack.engine.model.vision import Modality, VisionTower, check_grid, normalize_patches


class DecoderLayer(nn.Module):
    def __init__(self, text: TextConfig, layer: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        args = {"dtype": dtype, "device": device}
        self.input_norm = GemmaRMSNorm(text.hidden_size, text.rms_norm_eps, **args)
        self.attn = Attention(text, layer, **args)
        self.post_attention_norm = GemmaRMSNorm(text.hidden_size, text.rms_norm_eps, **args)
        self.mlp: nn.Module
        if text.moe_layers[layer]:
            self.mlp = MoE(text, **args)
        else:
            self.mlp = GatedMLP(
                text.hidden_size,
                text.dense_intermediate_size,
                alpha=text.swiglu_alpha,
                limit=text.swiglu_limit,
                **args,
            )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is the previous layer's MLP output (the embeddings for the first layer, with ``residual``
        None), ``residual`` the stream before it; returns this layer's MLP output and the stream before it.
        Keeping the add for the next norm lets the two run as one kernel."""
        if residual is None:
            residual, hidden = x, self.input_norm(x)
        else:
            hidden, residual = self.input_norm.add_forward(x, residual)
        hidden, residual = self.post_attention_norm.add_forward(self.attn(hidden, cos, sin, backend), residual)
        return self.mlp(hidden), residual


class M3ForServing(nn.Module):
    """``quantized``: parameter paths the checkpoint stores in MXFP8 (``loader.scan_checkpoint`` finds them); the
    model is then built on the meta device, given FP8 storage and scales there, and materialized on ``device``,
    so the float weights are never allocated."""

    def __init__(
        self,
        config: M3Config,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quantized: Collection[str] = (),
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        text = config.text
        args = {"dtype": dtype, "device": "meta" if quantized else device}
        self.embed_tokens = Embedding(text.vocab_size, text.hidden_size, **args)
        self.layers = nn.ModuleList(DecoderLayer(text, i, **args) for i in range(text.num_layers))
        self.norm = GemmaRMSNorm(text.hidden_size, text.rms_norm_eps, **args)
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False, **args)
        if text.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.vision = VisionTower(config.vision, **args)
        self.projector = Projector(
            config.vision.hidden_size, config.projector_hidden_size, text.hidden_size, config.merge_unit, **args
        )
        self.register_buffer(
            "inv_freq", inverse_frequencies(text.rotary_dim, text.rope_theta).to(args["device"]), persistent=False
        )
        if quantized:
            quantize_parameters(self, quantized)
            self.materialize(device)

    def materialize(self, device: torch.device | str) -> None:
        """Allocate the parameters of a model built on the meta device on ``device`` (uninitialized: a checkpoint
        fills them) and recompute the buffers ``to_empty`` leaves uninitialized (the RoPE frequencies)."""
        self.to_empty(device=device)
        text = self.config.text
        self.inv_freq = inverse_frequencies(text.rotary_dim, text.rope_theta).to(device)
        if self.vision is not None:
            vision = self.config.vision
            self.vision.inv_freq = inverse_frequencies(vision.rotary_axis_dim, vision.rope_theta).to(device)
        if text.tie_word_embeddings and isinstance(self.lm_head, Linear):  # to_empty gives each its own storage
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        mm_positions: torch.Tensor | None = None,
        mm_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of this step's tokens (see the module docstring)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [T]")
        x = self.embed_tokens(input_ids)
        if mm_positions is not None or mm_embeds is not None:
            x = self._place_multimodal(x, mm_positions, mm_embeds)
        cos, sin = text_cos_sin(positions, self.inv_freq, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attn)
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 logits ``[n, vocab]`` (the LM head runs in the model dtype)."""
        return self.lm_head(hidden).float()

    def encode_vision(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, modality: Modality | str
    ) -> torch.Tensor:
        """Patches of one or more items (uint8 or normalized floats) -> placeholder embeddings ``[N / 4, hidden]``.

        Rows follow the items' order in ``grid_thw``; each item yields ``t * h * w / merge_size**2`` rows, the
        number of placeholder tokens the processor put into the prompt for it.
        """
        modality = Modality(modality)  # also accepts "image" / "video"; anything else is a ValueError
        vision = self.config.vision
        if pixel_values.dim() != 2 or pixel_values.shape[1] != vision.patch_dim:
            raise ValueError(f"pixel_values must be [N, {vision.patch_dim}], got {tuple(pixel_values.shape)}")
        grid = check_grid(grid_thw, pixel_values.shape[0], vision.spatial_merge_size)
        if pixel_values.dtype == torch.uint8:
            norm = self.config.image_normalization if modality == Modality.IMAGE else self.config.video_normalization
            pixel_values = normalize_patches(pixel_values, norm)
        elif not pixel_values.is_floating_point():
            raise ValueError(f"pixel_values must be uint8 or floating point, got {pixel_values.dtype}")
        return self.projector(self.vision(pixel_values, grid))

    def kv_cache_spec(self, dtype: torch.dtype | None = None) -> KVCacheSpec:
        text = self.config.text
        return KVCacheSpec(
            num_layers=text.num_layers,
            num_kv_heads=text.num_kv_heads,
            head_dim=text.head_dim,
            block_size=text.index_block_size,
            index_head_dim=text.index_head_dim,
            sparse_layers=text.sparse_layers,
            dtype=dtype or self.dtype,
        )

    def _place_multimodal(
        self, x: torch.Tensor, mm_positions: torch.Tensor | None, mm_embeds: torch.Tensor | None
    ) -> torch.Tensor:
        if mm_positions is None or mm_embeds is None:
            raise ValueError("mm_positions and mm_embeds go together")
        if mm_positions.dim() != 1 or mm_embeds.shape != (mm_positions.shape[0], x.shape[1]):
            raise ValueError(
                f"mm_positions {tuple(mm_positions.shape)} / mm_embeds {tuple(mm_embeds.shape)}: "
                f"expected [N] and [N, {x.shape[1]}]"
            )
        x[mm_positions] = mm_embeds.to(x.dtype)
        return x
