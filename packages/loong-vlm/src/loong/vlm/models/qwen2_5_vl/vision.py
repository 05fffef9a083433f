"""Qwen2.5-VL's vision side: the windowed ViT (encoder family ``qwen2_5_vit``) and its patch merger (projector
family ``qwen2_5_merger``), as plain PyTorch modules.

The ViT: a linear patch embedding of the processor's flattened ``[C, T, P, P]`` patches (no bias), ``depth``
pre-RMSNorm blocks with 2-D RoPE attention and a gated MLP with biases. Blocks at ``fullatt_block_indexes``
attend over each whole frame; the others within windows of ``window_size // (spatial_merge_size * patch_size)``
merge units square (the last row/column of windows of an image may be partial). Internally the merge units are
reordered window by window, so every window (and every frame) is one contiguous document of
:func:`~loong.core.attention.varlen_attention`; the output is put back in the processor's order.

The merger: RMSNorm per patch, ``spatial_merge_size**2`` patches concatenated, ``fc2(GELU(fc1(·)))``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from loong.core.config.schema import check_config
from loong.core.errors import LoongError
from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.vision.common import (
    EncoderOutput,
    GatedMLP,
    PatchMerger,
    ProjectorOutput,
    RMSNorm,
    VisionAttention,
    VisionBlock,
    VitCost,
    activation,
    attention_pair_flops,
    check_pixel_values,
    frame_doc_ids,
    grid_list,
    host_to_device,
    rotary_cos_sin,
    vision_position_ids,
)


def window_units(cfg: EncoderConfig) -> int:
    """Side of a window in merge units: ``window_size // spatial_merge_size // patch_size`` (as HF computes it)."""
    return cfg.window_size // cfg.spatial_merge_size // cfg.patch_size


def check_encoder(cfg: EncoderConfig, path: str = "encoder") -> None:
    """The config's own checks plus this family's: windows of at least one merge unit, no DeepStack taps, a head
    width divisible by 4 (the 2-D RoPE splits it in quarters)."""
    check_config(cfg, path)
    if cfg.family != "qwen2_5_vit":
        raise LoongError(f"{path}.family: {cfg.family!r} given to the qwen2_5_vit builder")
    if window_units(cfg) < 1:
        raise LoongError(f"{path}.window_size={cfg.window_size}: must be >= spatial_merge_size * patch_size = "
                         f"{cfg.spatial_merge_size * cfg.patch_size} (a window of at least one merge unit)")
    if cfg.deepstack_visual_indexes:
        raise LoongError(f"{path}.deepstack_visual_indexes: qwen2_5_vit has no DeepStack taps; leave it empty")
    if cfg.head_dim % 4:
        raise LoongError(f"{path}: head_dim={cfg.head_dim} (hidden_size / num_heads) must be divisible by 4 for "
                         "the 2-D rotary embedding")


def window_layout(grid: list[tuple[int, int, int]], merge: int, units: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [n_units], window_ids [n_patches])``: the merge units (of all images, processor order) sorted
    window by window, and the window id of every patch in that sorted order (int64).

    Windows tile each frame of ``h/merge × w/merge`` units from the top-left in squares of ``units`` (partial
    at the bottom and right edges), row-major; units stay row-major inside a window (HF's
    ``get_vision_window_index``). Built on the host with numpy from the grid (on the device the bincount and
    the repeat would each sync it) and copied to ``device``."""
    orders, counts = [], []
    offset = 0
    for t, h, w in grid:
        lh, lw = h // merge, w // merge
        nwh, nww = math.ceil(lh / units), math.ceil(lw / units)
        win = (np.arange(lh)[:, None] // units) * nww + np.arange(lw) // units
        key = (np.arange(t)[:, None, None] * (nwh * nww) + win).reshape(-1)
        orders.append(np.argsort(key, kind="stable") + offset)
        counts.append(np.bincount(key, minlength=t * nwh * nww))  # every window holds >= 1 unit
        offset += t * lh * lw
    sizes = np.concatenate(counts) * merge * merge
    ids = np.repeat(np.arange(len(sizes)), sizes)
    return (host_to_device(torch.from_numpy(np.concatenate(orders)), device),
            host_to_device(torch.from_numpy(ids), device))


def _permute_units(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows of ``x [n, ...]`` reordered by merge units of ``unit`` consecutive rows."""
    return x.reshape(-1, unit, *x.shape[1:])[order].reshape(x.shape)


class Qwen2_5VisionEncoder(nn.Module):
    """Qwen2.5-VL's ViT. ``forward(pixel_values [n_patches, C*T*P*P], grid_thw [n_images, 3]) -> EncoderOutput``
    with ``hidden [n_patches, hidden_size]`` in the processor's order.

    ``attn_impl`` selects the varlen attention implementation (None: the reference; set it from the
    accelerator's capabilities with :func:`loong.core.attention.varlen.choose_varlen_impl`).
    """

    def __init__(self, cfg: EncoderConfig, attn_impl: str | None = None) -> None:
        super().__init__()
        check_encoder(cfg)
        d = cfg.hidden_size
        self.patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.merge = cfg.spatial_merge_size
        self.window_units = window_units(cfg)
        self.full_blocks = frozenset(int(i) for i in cfg.fullatt_block_indexes)
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.recompute = cfg.recompute
        self.attn_impl = attn_impl
        act = activation(cfg.hidden_act, "encoder.hidden_act")
        self.patch_embed = nn.Linear(self.patch_dim, d, bias=False)
        self.blocks = nn.ModuleList(
            VisionBlock(RMSNorm(d, cfg.norm_eps), VisionAttention(d, cfg.num_heads, qkv_bias=cfg.qkv_bias),
                        RMSNorm(d, cfg.norm_eps), GatedMLP(d, cfg.intermediate_size, act, bias=True))
            for _ in range(cfg.depth))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> EncoderOutput:
        grid = grid_list(grid_thw, self.merge)
        check_pixel_values(pixel_values, grid, self.patch_dim)
        dev = pixel_values.device
        unit = self.merge * self.merge
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        cos, sin = rotary_cos_sin(vision_position_ids(grid, self.merge, dev), self.head_dim, self.rope_theta)
        order, window_ids = window_layout(grid, self.merge, self.window_units, dev)
        x, cos, sin = (_permute_units(t, order, unit) for t in (x, cos, sin))
        # windows never cross frames, so in window order the frames are still contiguous, in the same order
        frames = frame_doc_ids(grid, dev)
        for i, block in enumerate(self.blocks):
            ids = frames if i in self.full_blocks else window_ids
            if self.recompute and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, ids, (cos, sin), self.attn_impl, use_reentrant=False)
            else:
                x = block(x, ids, (cos, sin), self.attn_impl)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=dev)
        return EncoderOutput(hidden=_permute_units(x, inverse, unit))


def projector_inner(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> int:
    """The merger MLP's inner width: ``proj_cfg.hidden_size`` or, when 0, ``hidden_size * spatial_merge_size**2``."""
    return proj_cfg.hidden_size or enc_cfg.hidden_size * enc_cfg.spatial_merge_size ** 2


class Qwen2_5Projector(nn.Module):
    """Qwen2.5-VL's patch merger: ``forward(EncoderOutput, grid_thw) -> ProjectorOutput(embeds [n_patches /
    spatial_merge_size**2, out_hidden_size])``, one embedding per image placeholder token."""

    def __init__(self, proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> None:
        super().__init__()
        check_config(proj_cfg, "projector")
        if proj_cfg.family != "qwen2_5_merger":
            raise LoongError(f"projector.family: {proj_cfg.family!r} given to the qwen2_5_merger builder")
        self.merger = PatchMerger(enc_cfg.hidden_size, enc_cfg.spatial_merge_size ** 2,
                                  projector_inner(proj_cfg, enc_cfg), proj_cfg.out_hidden_size, norm="rms",
                                  eps=enc_cfg.norm_eps, act=activation(proj_cfg.hidden_act, "projector.hidden_act"))

    def forward(self, out: EncoderOutput, grid_thw: torch.Tensor | None = None) -> ProjectorOutput:
        return ProjectorOutput(embeds=self.merger(out.hidden))


# ------------------------------------------------------------------------------------ parameters and FLOPs

def encoder_num_parameters(cfg: EncoderConfig) -> int:
    """Analytic parameter count of :class:`Qwen2_5VisionEncoder`."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2 * d
    attn = 3 * d * d + (3 * d if cfg.qkv_bias else 0) + d * d + d
    block = 2 * d + attn + 3 * d * f + 2 * f + d
    return patch + cfg.depth * block


def projector_num_parameters(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> int:
    """Analytic parameter count of :class:`Qwen2_5Projector`."""
    d, h = enc_cfg.hidden_size, enc_cfg.hidden_size * enc_cfg.spatial_merge_size ** 2
    inner, out = projector_inner(proj_cfg, enc_cfg), proj_cfg.out_hidden_size
    return d + h * inner + inner + inner * out + out


def _linear_flops_per_patch(cfg: EncoderConfig) -> int:
    d, f = cfg.hidden_size, cfg.intermediate_size
    patch = 2 * cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2 * d
    return patch + cfg.depth * 2 * (3 * d * d + d * d + 3 * d * f)


def projector_flops_per_patch(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> float:
    """Forward FLOPs of the merger per encoder patch (its two matmuls per merged token / ``merge**2``)."""
    h = enc_cfg.hidden_size * enc_cfg.spatial_merge_size ** 2
    inner = projector_inner(proj_cfg, enc_cfg)
    return 2 * (h * inner + inner * proj_cfg.out_hidden_size) / enc_cfg.spatial_merge_size ** 2


def encoder_flops(cfg: EncoderConfig, grid_thw: torch.Tensor | list) -> list[float]:
    """Exact forward FLOPs (matmuls, 2 per multiply-add) of the ViT for each image/video of ``grid_thw``.

    Per frame of ``n = h·w`` patches: the per-patch layers, the full-attention blocks' ``4·hidden·n²`` and the
    windowed blocks' ``4·hidden·Σ window_patches²`` over the actual (partly partial) windows."""
    grid = grid_list(grid_thw, cfg.spatial_merge_size)
    m, u = cfg.spatial_merge_size, window_units(cfg)
    n_full = len(set(int(i) for i in cfg.fullatt_block_indexes))
    n_win = cfg.depth - n_full
    pair = attention_pair_flops(cfg.hidden_size)
    lin = _linear_flops_per_patch(cfg)

    def extents_sq(units: int) -> int:  # sum of squared window extents (merge units) along one axis
        full, rest = divmod(units, u)
        return full * u * u + rest * rest

    out = []
    for t, h, w in grid:
        n = h * w
        windows = m ** 4 * extents_sq(h // m) * extents_sq(w // m)
        out.append(float(t * (lin * n + pair * (n_full * n * n + n_win * windows))))
    return out


def encoder_cost(cfg: EncoderConfig) -> VitCost:
    """``VitCost`` of one frame of ``n`` patches: full-attention blocks in the quadratic term, windowed blocks
    charged at the full window size (an upper bound for partial windows) in the linear term."""
    n_full = len(set(int(i) for i in cfg.fullatt_block_indexes))
    pair = attention_pair_flops(cfg.hidden_size)
    window_patches = (window_units(cfg) * cfg.spatial_merge_size) ** 2
    return VitCost(quadratic=float(pair * n_full),
                   linear=float(_linear_flops_per_patch(cfg) + pair * (cfg.depth - n_full) * window_patches))


__all__ = ["Qwen2_5Projector", "Qwen2_5VisionEncoder", "check_encoder", "encoder_cost", "encoder_flops",
           "encoder_num_parameters", "projector_flops_per_patch", "projector_inner", "projector_num_parameters",
           "window_layout", "window_units"]
