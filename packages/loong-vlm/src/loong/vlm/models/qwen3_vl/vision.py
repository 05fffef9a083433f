"""Qwen3-VL's vision side (dense and MoE share it): the ViT (encoder family ``qwen3_vit``) and its patch merger
with the DeepStack mergers (projector family ``qwen3_merger``), as plain PyTorch modules.

The ViT: a linear patch embedding with bias of the processor's flattened ``[C, T, P, P]`` patches, plus learned
position embeddings (a square ``side × side`` table, ``side² = num_position_embeddings``) bilinearly resampled to
each image's patch grid with aligned corners; ``depth`` pre-LayerNorm blocks with 2-D RoPE attention over each
frame and a ``fc2(act(fc1(·)))`` MLP (``gelu_pytorch_tanh``). The hidden states after the blocks of
``deepstack_visual_indexes`` are the encoder's ``intermediates``.

The projector: the main merger (LayerNorm per patch, ``spatial_merge_size**2`` patches concatenated,
``fc2(GELU(fc1(·)))``) on the final features, and one DeepStack merger per tapped block (LayerNorm on the
concatenated patches) on its intermediate.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from loong.core.config.schema import check_config
from loong.core.errors import LoongError
from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.vision.common import (
    MLP,
    EncoderOutput,
    PatchMerger,
    ProjectorOutput,
    VisionAttention,
    VisionBlock,
    VitCost,
    activation,
    attention_pair_flops,
    check_pixel_values,
    frame_doc_ids,
    grid_list,
    rotary_cos_sin,
    sqrt_int,
    vision_position_ids,
)


def check_encoder(cfg: EncoderConfig, path: str = "encoder") -> None:
    """The config's own checks plus this family's: a square position table, DeepStack taps strictly increasing,
    a head width divisible by 4 (the 2-D RoPE splits it in quarters)."""
    check_config(cfg, path)
    if cfg.family != "qwen3_vit":
        raise LoongError(f"{path}.family: {cfg.family!r} given to the qwen3_vit builder")
    if cfg.num_position_embeddings < 1:
        raise LoongError(f"{path}.num_position_embeddings: qwen3_vit needs a learned position table (>= 1), "
                         f"got {cfg.num_position_embeddings}")
    sqrt_int(cfg.num_position_embeddings, f"{path}.num_position_embeddings")
    taps = [int(i) for i in cfg.deepstack_visual_indexes]
    if any(b <= a for a, b in zip(taps, taps[1:], strict=False)):
        raise LoongError(f"{path}.deepstack_visual_indexes: {taps} must be strictly increasing (the DeepStack "
                         "embeddings feed the foundation's first layers in this order)")
    if cfg.head_dim % 4:
        raise LoongError(f"{path}: head_dim={cfg.head_dim} (hidden_size / num_heads) must be divisible by 4 for "
                         "the 2-D rotary embedding")


def _axis_taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps ``[size, 2]`` into a ``side``-long axis and their weights, aligned corners (position ``i``
    samples ``i·(side-1)/(size-1)``); the upper tap is clamped at the edge where its weight is 0."""
    src = torch.arange(size, device=device, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    low = src.floor()
    offsets = torch.arange(2, device=device)
    taps = (low.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - low[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def interpolated_positions(table: torch.Tensor, grid: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """``[n_patches, hidden]`` learned positions of every patch (processor order), float32.

    ``table [side², hidden]`` is a ``side × side`` grid resampled to each image's ``h × w`` patches as
    ``F.interpolate(mode="bilinear", align_corners=True)`` would, written as a 4-tap gather (taps ordered
    (top-left, top-right, bottom-left, bottom-right), HF's ``get_vision_interpolation_indices_and_weights``);
    a video repeats its frame's positions."""
    side = sqrt_int(table.shape[0], "pos_embed")
    parts = []
    for t, h, w in grid:
        rows, row_w = _axis_taps(h, side, table.device)
        cols, col_w = _axis_taps(w, side, table.device)
        index = (rows[:, None, :, None] * side + cols[None, :, None, :]).reshape(h, w, 4)
        weight = (row_w[:, None, :, None] * col_w[None, :, None, :]).reshape(h, w, 4, 1)
        pos = (table[index] * weight).sum(2)  # [h, w, hidden]
        pos = pos.reshape(h // merge, merge, w // merge, merge, -1).transpose(1, 2).reshape(h * w, -1)
        parts.append(pos.repeat(t, 1))
    return torch.cat(parts)


class Qwen3VisionEncoder(nn.Module):
    """Qwen3-VL's ViT. ``forward(pixel_values [n_patches, C*T*P*P], grid_thw [n_images, 3]) -> EncoderOutput``
    with ``hidden [n_patches, hidden_size]`` in the processor's order and ``intermediates`` the hidden states
    after the blocks of ``deepstack_visual_indexes``, in that order.

    ``attn_impl`` selects the varlen attention implementation (None: the reference; set it from the
    accelerator's capabilities with :func:`loong.core.attention.varlen.choose_varlen_impl`).
    """

    def __init__(self, cfg: EncoderConfig, attn_impl: str | None = None) -> None:
        super().__init__()
        check_encoder(cfg)
        d = cfg.hidden_size
        self.patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.merge = cfg.spatial_merge_size
        self.taps = [int(i) for i in cfg.deepstack_visual_indexes]
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.recompute = cfg.recompute
        self.attn_impl = attn_impl
        act = activation(cfg.hidden_act, "encoder.hidden_act")
        self.patch_embed = nn.Linear(self.patch_dim, d, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, d)
        self.blocks = nn.ModuleList(
            VisionBlock(nn.LayerNorm(d, eps=cfg.norm_eps), VisionAttention(d, cfg.num_heads, qkv_bias=cfg.qkv_bias),
                        nn.LayerNorm(d, eps=cfg.norm_eps), MLP(d, cfg.intermediate_size, act))
            for _ in range(cfg.depth))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> EncoderOutput:
        grid = grid_list(grid_thw, self.merge)
        check_pixel_values(pixel_values, grid, self.patch_dim)
        dev = pixel_values.device
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        x = x + interpolated_positions(self.pos_embed.weight, grid, self.merge).to(x.dtype)
        rope = rotary_cos_sin(vision_position_ids(grid, self.merge, dev), self.head_dim, self.rope_theta)
        frames = frame_doc_ids(grid, dev)
        intermediates = []
        for i, block in enumerate(self.blocks):
            if self.recompute and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, frames, rope, self.attn_impl, use_reentrant=False)
            else:
                x = block(x, frames, rope, self.attn_impl)
            if i in self.taps:
                intermediates.append(x)
        return EncoderOutput(hidden=x, intermediates=intermediates)


def projector_inner(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> int:
    """The mergers' inner width: ``proj_cfg.hidden_size`` or, when 0, ``hidden_size * spatial_merge_size**2``."""
    return proj_cfg.hidden_size or enc_cfg.hidden_size * enc_cfg.spatial_merge_size ** 2


class Qwen3Projector(nn.Module):
    """Qwen3-VL's patch merger and DeepStack mergers: ``forward(EncoderOutput, grid_thw) -> ProjectorOutput``,
    ``embeds [n_patches / spatial_merge_size**2, out_hidden_size]`` from the final features and ``deepstack`` one
    such tensor per ``deepstack_visual_indexes`` entry (from ``out.intermediates``, same order)."""

    def __init__(self, proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> None:
        super().__init__()
        check_config(proj_cfg, "projector")
        if proj_cfg.family != "qwen3_merger":
            raise LoongError(f"projector.family: {proj_cfg.family!r} given to the qwen3_merger builder")
        d, merge = enc_cfg.hidden_size, enc_cfg.spatial_merge_size ** 2
        inner, out = projector_inner(proj_cfg, enc_cfg), proj_cfg.out_hidden_size
        act = activation(proj_cfg.hidden_act, "projector.hidden_act")
        self.merger = PatchMerger(d, merge, inner, out, norm="layer", eps=enc_cfg.norm_eps, act=act)
        self.deepstack = nn.ModuleList(
            PatchMerger(d, merge, inner, out, norm="layer", eps=enc_cfg.norm_eps, act=act, postshuffle_norm=True)
            for _ in enc_cfg.deepstack_visual_indexes)

    def forward(self, out: EncoderOutput, grid_thw: torch.Tensor | None = None) -> ProjectorOutput:
        if len(out.intermediates) != len(self.deepstack):
            raise LoongError(f"qwen3_merger: the encoder gave {len(out.intermediates)} intermediates for "
                             f"{len(self.deepstack)} DeepStack mergers (encoder.deepstack_visual_indexes)")
        return ProjectorOutput(embeds=self.merger(out.hidden),
                               deepstack=[m(h) for m, h in zip(self.deepstack, out.intermediates, strict=True)])


# ------------------------------------------------------------------------------------ parameters and FLOPs

def encoder_num_parameters(cfg: EncoderConfig) -> int:
    """Analytic parameter count of :class:`Qwen3VisionEncoder`."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    patch = (cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2 + 1) * d
    attn = 3 * d * d + (3 * d if cfg.qkv_bias else 0) + d * d + d
    block = 4 * d + attn + 2 * d * f + f + d
    return patch + cfg.num_position_embeddings * d + cfg.depth * block


def projector_num_parameters(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> int:
    """Analytic parameter count of :class:`Qwen3Projector` (main merger + DeepStack mergers)."""
    d, h = enc_cfg.hidden_size, enc_cfg.hidden_size * enc_cfg.spatial_merge_size ** 2
    inner, out = projector_inner(proj_cfg, enc_cfg), proj_cfg.out_hidden_size
    mlp = h * inner + inner + inner * out + out
    return 2 * d + mlp + len(enc_cfg.deepstack_visual_indexes) * (2 * h + mlp)


def _linear_flops_per_patch(cfg: EncoderConfig) -> int:
    d, f = cfg.hidden_size, cfg.intermediate_size
    patch = 2 * cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2 * d
    return patch + cfg.depth * 2 * (3 * d * d + d * d + 2 * d * f)


def projector_flops_per_patch(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> float:
    """Forward FLOPs of the main and DeepStack mergers per encoder patch."""
    h, inner = enc_cfg.hidden_size * enc_cfg.spatial_merge_size ** 2, projector_inner(proj_cfg, enc_cfg)
    mergers = 1 + len(enc_cfg.deepstack_visual_indexes)
    return mergers * 2 * (h * inner + inner * proj_cfg.out_hidden_size) / enc_cfg.spatial_merge_size ** 2


def encoder_cost(cfg: EncoderConfig) -> VitCost:
    """``VitCost`` of one frame of ``n`` patches: every block attends over the whole frame."""
    return VitCost(quadratic=float(attention_pair_flops(cfg.hidden_size) * cfg.depth),
                   linear=float(_linear_flops_per_patch(cfg)))


def encoder_flops(cfg: EncoderConfig, grid_thw: torch.Tensor | list) -> list[float]:
    """Exact forward FLOPs (matmuls, 2 per multiply-add) of the ViT for each image/video of ``grid_thw``:
    ``t · cost(h·w)`` (each frame attends within itself)."""
    cost = encoder_cost(cfg)
    return [float(t * cost(h * w)) for t, h, w in grid_list(grid_thw, cfg.spatial_merge_size)]


__all__ = ["Qwen3Projector", "Qwen3VisionEncoder", "check_encoder", "encoder_cost", "encoder_flops",
           "encoder_num_parameters", "interpolated_positions", "projector_flops_per_patch", "projector_inner",
           "projector_num_parameters"]
