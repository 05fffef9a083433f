"""SigLIP2's NaFlex vision transformer (HF ``Siglip2VisionModel``) and a LLaVA-style MLP projector, as plain
PyTorch modules.

NaFlex keeps each image's aspect ratio: the image processor resizes it to an ``h x w`` grid of ``P x P`` patches
(at most ``max_num_patches``), flattens each patch (``P*P*C``, channels last) and pads the batch in the patch
dimension, giving ``pixel_values [B, max_num_patches, P*P*C]``, ``pixel_attention_mask [B, max_num_patches]`` (the
first ``h*w`` entries of a row are 1) and ``spatial_shapes [B, 2] = (h, w)``.

Here the images' valid patches are packed into one sequence and attend within their own image through the core's
varlen attention (no dense ``[n, n]`` mask); the learned ``g x g`` position table is resized to each image's
``(h, w)`` with bilinear + antialias interpolation, as HF does.

The attention-pooling head (``Siglip2VisionModel.head``, the contrastive image embedding) is left out: a VLM
(PaliGemma-, Eagle-style) takes the patch features after ``post_layernorm``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from loong.core.config.schema import check_config
from loong.core.errors import LoongError
from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.vision.common import (
    MLP,
    EncoderOutput,
    ProjectorOutput,
    VisionAttention,
    VisionBlock,
    VitCost,
    activation,
    attention_pair_flops,
    host_to_device,
    sqrt_int,
)


def spatial_shapes(grid_thw: torch.Tensor) -> list[tuple[int, int]]:
    """Each image's patch grid ``(h, w)`` from ``grid_thw``: HF's ``spatial_shapes [n, 2]`` or ``[n, 3]`` rows
    ``(1, h, w)`` (SigLIP2 takes images: one frame)."""
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.dim() != 2 or grid_thw.shape[1] not in (2, 3):
        raise LoongError("SigLIP2 grid_thw must be the image processor's spatial_shapes [n_images, 2] (h, w) or "
                         f"[n_images, 3] (1, h, w), got {getattr(grid_thw, 'shape', type(grid_thw))}")
    rows = grid_thw.tolist()
    if not rows:
        raise LoongError("SigLIP2 grid_thw: no images")
    if grid_thw.shape[1] == 3:
        if any(t != 1 for t, _, _ in rows):
            raise LoongError(f"SigLIP2 grid_thw: every image has t=1 (no video), got {rows}")
        rows = [r[1:] for r in rows]
    if any(h < 1 or w < 1 for h, w in rows):
        raise LoongError(f"SigLIP2 grid_thw: patch grids must be at least 1x1, got {rows}")
    return [(int(h), int(w)) for h, w in rows]


def pack_patches(pixel_values: torch.Tensor, shapes: list[tuple[int, int]]) -> torch.Tensor:
    """The valid patches of every image, concatenated: ``[sum h*w, P*P*C]``. ``pixel_values`` is already packed
    (``[sum h*w, P*P*C]``) or the processor's padded ``[B, L, P*P*C]`` whose row ``i`` holds ``h_i * w_i`` valid
    patches first (the layout ``pixel_attention_mask`` marks)."""
    counts = [h * w for h, w in shapes]
    if pixel_values.dim() == 2:
        if pixel_values.shape[0] != sum(counts):
            raise LoongError(f"SigLIP2 pixel_values has {pixel_values.shape[0]} patches but grid_thw makes "
                             f"{sum(counts)} ({shapes})")
        return pixel_values
    if pixel_values.dim() != 3 or pixel_values.shape[0] != len(shapes) or max(counts) > pixel_values.shape[1]:
        raise LoongError(f"SigLIP2 pixel_values must be packed [n_patches, P*P*C] or padded [n_images, "
                         f"max_num_patches, P*P*C] holding grid_thw's {shapes} patches, got "
                         f"{tuple(pixel_values.shape)}")
    return torch.cat([pixel_values[i, :n] for i, n in enumerate(counts)])


def check_encoder(cfg: EncoderConfig, path: str = "encoder") -> None:
    """The config's own checks plus this family's: a square position table, biased attention projections."""
    check_config(cfg, path)
    if cfg.family != "siglip2":
        raise LoongError(f"{path}.family: {cfg.family!r} given to the siglip2 builder")
    if cfg.num_position_embeddings < 1:
        raise LoongError(f"{path}.num_position_embeddings: siglip2 needs a learned position table (HF's "
                         f"num_patches, e.g. 256 = 16x16), got {cfg.num_position_embeddings}")
    sqrt_int(cfg.num_position_embeddings, f"{path}.num_position_embeddings")
    if not cfg.qkv_bias:
        raise LoongError(f"{path}.qkv_bias=false: SigLIP2's attention projections always have biases")


class Siglip2VisionEncoder(nn.Module):
    """SigLIP2 NaFlex ViT: linear ``patch_embed`` of flattened patches, learned positions ``pos_embed`` (a
    ``g x g`` table) resized to each image's grid, ``depth`` pre-LayerNorm blocks (biased fused ``qkv`` laid out
    per head, ``proj``; ``fc2(act(fc1(.)))`` MLP) and a final LayerNorm ``norm`` (HF's ``post_layernorm``).

    ``forward(pixel_values, grid_thw) -> EncoderOutput(hidden [sum h*w, d])``: ``pixel_values`` packed
    ``[sum h*w, P*P*C]`` or the processor's padded ``[B, L, P*P*C]``; ``grid_thw`` the ``spatial_shapes``
    (``[n, 2]``, or ``[n, 3]`` with t=1). Rows are the valid patches, image by image, row-major in each image;
    each image attends to itself (varlen attention, one document per image).

    ``attn_impl`` selects the varlen attention implementation (None: the reference; set it from the
    accelerator's capabilities with :func:`loong.core.attention.varlen.choose_varlen_impl`).
    """

    def __init__(self, cfg: EncoderConfig, attn_impl: str | None = None) -> None:
        super().__init__()
        check_encoder(cfg)
        d = cfg.hidden_size
        self.grid = sqrt_int(cfg.num_position_embeddings, "encoder.num_position_embeddings")
        self.patch_dim = cfg.in_channels * cfg.patch_size ** 2
        self.recompute = cfg.recompute
        self.attn_impl = attn_impl
        act = activation(cfg.hidden_act, "encoder.hidden_act")
        self.patch_embed = nn.Linear(self.patch_dim, d)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, d)
        self.blocks = nn.ModuleList(
            VisionBlock(nn.LayerNorm(d, eps=cfg.norm_eps), VisionAttention(d, cfg.num_heads),
                        nn.LayerNorm(d, eps=cfg.norm_eps), MLP(d, cfg.intermediate_size, act))
            for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(d, eps=cfg.norm_eps)

    def resized_positions(self, shapes: list[tuple[int, int]]) -> torch.Tensor:
        """``[sum h*w, d]``: the position table resized to each ``(h, w)`` (bilinear, antialias, in fp32 as HF),
        once per distinct shape, rows row-major over the image."""
        g, d = self.grid, self.pos_embed.weight.shape[-1]
        table = self.pos_embed.weight.float().reshape(g, g, d).permute(2, 0, 1).unsqueeze(0)
        resized: dict[tuple[int, int], torch.Tensor] = {}
        for shape in dict.fromkeys(shapes):
            grid = F.interpolate(table, size=shape, mode="bilinear", align_corners=False, antialias=True)
            resized[shape] = grid[0].reshape(d, -1).transpose(0, 1)
        return torch.cat([resized[s] for s in shapes])

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> EncoderOutput:
        shapes = spatial_shapes(grid_thw)
        patches = pack_patches(pixel_values, shapes)
        if patches.shape[-1] != self.patch_dim:
            raise LoongError(f"SigLIP2 patches have {patches.shape[-1]} values, the encoder takes "
                             f"{self.patch_dim} (encoder.in_channels * encoder.patch_size**2)")
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))
        # HF rounds the resized table to the table's dtype before adding it
        x = x + self.resized_positions(shapes).to(self.pos_embed.weight.dtype).to(x.dtype)
        counts = [h * w for h, w in shapes]  # on the host (no device sync), then copied
        doc_ids = host_to_device(torch.from_numpy(np.repeat(np.arange(len(shapes), dtype=np.int64), counts)),
                                 x.device)
        for block in self.blocks:
            if self.recompute and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, doc_ids, None, self.attn_impl, use_reentrant=False)
            else:
                x = block(x, doc_ids, None, self.attn_impl)
        return EncoderOutput(hidden=self.norm(x))


def check_projector(proj_cfg: ProjectorConfig) -> None:
    """The config's own checks, for family ``mlp``."""
    check_config(proj_cfg, "projector")
    if proj_cfg.family != "mlp":
        raise LoongError(f"projector.family: {proj_cfg.family!r} given to the mlp builder")


def projector_inner(proj_cfg: ProjectorConfig) -> int:
    """The MLP's inner width: ``hidden_size`` or, when 0, ``out_hidden_size`` (LLaVA's)."""
    return proj_cfg.hidden_size or proj_cfg.out_hidden_size


class MLPProjector(nn.Module):
    """LLaVA-style projector: ``fc2(act(fc1(x)))`` on each patch feature, no LayerNorm, to the foundation's
    width (``out_hidden_size``; the inner width is ``hidden_size`` or, when 0, ``out_hidden_size`` as LLaVA's
    ``LlavaMultiModalProjector``). One token per patch.

    ``forward(out: EncoderOutput, grid_thw=None) -> ProjectorOutput(embeds [n_patches, out_hidden_size])``.
    """

    def __init__(self, proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> None:
        super().__init__()
        check_projector(proj_cfg)
        inner = projector_inner(proj_cfg)
        self.fc1 = nn.Linear(enc_cfg.hidden_size, inner)
        self.fc2 = nn.Linear(inner, proj_cfg.out_hidden_size)
        self.act = activation(proj_cfg.hidden_act, "projector.hidden_act")

    def forward(self, out: EncoderOutput, grid_thw: torch.Tensor | None = None) -> ProjectorOutput:
        return ProjectorOutput(embeds=self.fc2(self.act(self.fc1(out.hidden))))


# ------------------------------------------------------------------------------------ parameters and FLOPs

def encoder_num_parameters(cfg: EncoderConfig) -> int:
    """Analytic parameter count of :class:`Siglip2VisionEncoder` (no pooling head)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    embed = (cfg.in_channels * cfg.patch_size ** 2 + 1) * d + cfg.num_position_embeddings * d
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d * f + f + d
    return embed + cfg.depth * block + 2 * d


def projector_num_parameters(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> int:
    """Analytic parameter count of :class:`MLPProjector`."""
    inner, out = projector_inner(proj_cfg), proj_cfg.out_hidden_size
    return enc_cfg.hidden_size * inner + inner + inner * out + out


def projector_flops_per_patch(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> float:
    """Forward FLOPs of the projector per encoder patch (one token per patch)."""
    inner = projector_inner(proj_cfg)
    return float(2 * (enc_cfg.hidden_size * inner + inner * proj_cfg.out_hidden_size))


def encoder_cost(cfg: EncoderConfig) -> VitCost:
    """``VitCost`` of one image of ``n`` patches: every block attends over the whole image."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    linear = 2 * cfg.in_channels * cfg.patch_size ** 2 * d + cfg.depth * 2 * (3 * d * d + d * d + 2 * d * f)
    return VitCost(quadratic=float(attention_pair_flops(d) * cfg.depth), linear=float(linear))


def encoder_flops(cfg: EncoderConfig, grid_thw: torch.Tensor) -> list[float]:
    """Forward FLOPs (matmuls, 2 per multiply-add) of the ViT for each image of ``grid_thw`` (spatial shapes)."""
    cost = encoder_cost(cfg)
    return [float(cost(h * w)) for h, w in spatial_shapes(grid_thw)]


__all__ = ["MLPProjector", "Siglip2VisionEncoder", "check_encoder", "check_projector", "encoder_cost",
           "encoder_flops", "encoder_num_parameters", "pack_patches", "projector_flops_per_patch",
           "projector_inner", "projector_num_parameters", "spatial_shapes"]
