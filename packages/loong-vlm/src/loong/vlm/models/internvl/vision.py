"""InternVL 3.5's vision side as plain PyTorch modules: InternViT (HF ``InternVLVisionModel``) and the
pixel-shuffle MLP projector (HF ``InternVLMultiModalProjector`` after ``InternVLModel.pixel_shuffle``).

The image processor (transformers' GotOcr2 image processor with ``crop_to_patches``, which ``InternVLProcessor``
uses) cuts each image into ``image_size`` tiles plus a thumbnail, so ``pixel_values`` is ``[n_tiles, C, S, S]``
with every tile of one size: attention runs batched over the tiles (each tile attends to itself), no mask.

The encoder returns the patch features of every tile, CLS token dropped (HF's ``vision_feature_select_strategy
="default"``) and in raster order per tile, tiles concatenated: ``hidden [n_tiles * (S/P)**2, hidden]``. The
projector pixel-shuffles each tile's ``(S/P) x (S/P)`` grid by ``1 / downsample_ratio`` and projects:
``(S/P * downsample_ratio)**2`` tokens per tile, the ``image_seq_length`` placeholders the processor writes per tile.
"""

from __future__ import annotations

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
    RMSNorm,
    VitCost,
    activation,
    attention_pair_flops,
    init_vision_weights,
    make_norm,
)


class InternVisionAttention(nn.Module):
    """Multi-head self-attention over ``[tiles, seq, hidden]``: a fused ``qkv`` whose output rows are laid out per
    head ``[heads, 3 (q, k, v), head_dim]`` (as :class:`~loong.vlm.models.vision.common.VisionAttention`, so a
    contiguous tensor-parallel column shard holds whole heads; the head count is read from the weight) and an
    output ``proj`` (row-parallel).

    The optional QK norm (InternViT-6B; not the 300M tower of InternVL 3.5 1B/8B) is an RMSNorm over *all* heads'
    queries / keys, as in HF: a sharded run must all-reduce its statistics.
    """

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(d, 3 * d, bias=cfg.qkv_bias)
        self.proj = nn.Linear(d, d)
        self.q_norm = RMSNorm(d, cfg.norm_eps) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(d, cfg.norm_eps) if cfg.use_qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads = self.qkv.out_features // (3 * self.head_dim)
        q, k, v = self.qkv(x).view(b, s, heads, 3, self.head_dim).unbind(3)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(b, s, -1)).view(b, s, heads, self.head_dim)
            k = self.k_norm(k.reshape(b, s, -1)).view(b, s, heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(out.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class InternVisionBlock(nn.Module):
    """Pre-norm block with layer scale: ``x + ls1 * attn(norm1(x))``, then ``x + ls2 * mlp(norm2(x))``."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        kind = "rms" if cfg.norm_type == "rms_norm" else "layer"
        self.norm1 = make_norm(kind, d, cfg.norm_eps)
        self.attn = InternVisionAttention(cfg)
        self.ls1 = nn.Parameter(torch.full((d,), float(cfg.layer_scale_init_value)))
        self.norm2 = make_norm(kind, d, cfg.norm_eps)
        self.mlp = MLP(d, cfg.intermediate_size, activation(cfg.hidden_act, "encoder.hidden_act"))
        self.ls2 = nn.Parameter(torch.full((d,), float(cfg.layer_scale_init_value)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1 * self.attn(self.norm1(x))
        return x + self.ls2 * self.mlp(self.norm2(x))


def tile_grid(cfg: EncoderConfig) -> int:
    """Patches along one side of a tile, ``image_size // patch_size``; a LoongError when it does not divide."""
    if cfg.image_size % cfg.patch_size:
        raise LoongError(f"encoder.image_size={cfg.image_size} is not a multiple of "
                         f"encoder.patch_size={cfg.patch_size}")
    return cfg.image_size // cfg.patch_size


def check_encoder(cfg: EncoderConfig, path: str = "encoder") -> None:
    """The config's own checks plus this family's: tiles made of whole patches."""
    check_config(cfg, path)
    if cfg.family != "intern_vit":
        raise LoongError(f"{path}.family: {cfg.family!r} given to the intern_vit builder")
    tile_grid(cfg)


class InternVisionEncoder(nn.Module):
    """InternViT: a linear patch embedding (HF's Conv2d with kernel = stride = patch, as a Linear on the
    flattened ``[C, P, P]`` patch), a CLS token, learned absolute positions for ``1 + (S/P)**2`` tokens, ``depth``
    :class:`InternVisionBlock` s and, when ``use_mean_pooling`` is off, a final LayerNorm (HF's ``layernorm``).

    ``forward(pixel_values [n_tiles, C, S, S], grid_thw=None) -> EncoderOutput(hidden [n_tiles * (S/P)**2, d])``:
    the last block's output (after the final norm: HF's ``last_hidden_state``, ``vision_feature_layer=-1``) with
    the CLS token dropped. Tiles all have one size, so attention is batched SDPA over tiles: no varlen needed.
    """

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        check_encoder(cfg)
        d, p, c = cfg.hidden_size, cfg.patch_size, cfg.in_channels
        self.side = tile_grid(cfg)
        self.patch_size, self.in_channels, self.image_size = p, c, cfg.image_size
        self.recompute = cfg.recompute
        self.patch_embed = nn.Linear(c * p * p, d)
        self.cls_token = nn.Parameter(torch.zeros(d))
        self.pos_embed = nn.Parameter(torch.zeros(self.side * self.side + 1, d))
        self.blocks = nn.ModuleList(InternVisionBlock(cfg) for _ in range(cfg.depth))
        self.norm = None if cfg.use_mean_pooling else nn.LayerNorm(d, eps=cfg.norm_eps)

    def reset_parameters(self, std: float, layer_scale: float) -> None:
        """:func:`~loong.vlm.models.vision.common.init_vision_weights` (N(0, ``std``) linears, zero biases, unit
        norms), positions N(0, ``std``), CLS 0, layer scales ``layer_scale`` (HF's ``layer_scale_init_value``)."""
        init_vision_weights(self, std)
        nn.init.normal_(self.pos_embed, std=std)
        nn.init.zeros_(self.cls_token)
        for block in self.blocks:
            nn.init.constant_(block.ls1, layer_scale)
            nn.init.constant_(block.ls2, layer_scale)

    def patchify(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[n, C, S, S] -> [n, (S/P)**2, C*P*P]``: raster order of patches, each flattened as ``(C, P, P)`` (the
        order of the Conv2d weight HF stores)."""
        n, p, g = pixel_values.shape[0], self.patch_size, self.side
        x = pixel_values.reshape(n, self.in_channels, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(n, g * g, self.in_channels * p * p)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None) -> EncoderOutput:
        want = (self.in_channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != want:
            raise LoongError(f"InternViT pixel_values must be [n_tiles, {want[0]}, {want[1]}, {want[2]}] "
                             f"(encoder.image_size tiles from the InternVL image processor), got "
                             f"{list(pixel_values.shape)}")
        if grid_thw is not None:
            raise LoongError("InternViT takes grid_thw=None: its tiles all have encoder.image_size")
        x = self.patch_embed(self.patchify(pixel_values).to(self.patch_embed.weight.dtype))
        cls = self.cls_token.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed.to(x.dtype)
        for block in self.blocks:
            if self.recompute and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        return EncoderOutput(hidden=x[:, 1:].reshape(-1, x.shape[-1]))


def shuffle_factor(proj_cfg: ProjectorConfig) -> int:
    """``1 / downsample_ratio`` as an integer (2 for InternVL's 0.5); a LoongError when it is not one."""
    k = round(1 / proj_cfg.downsample_ratio)
    if abs(k * proj_cfg.downsample_ratio - 1) > 1e-6:
        raise LoongError(f"projector.downsample_ratio={proj_cfg.downsample_ratio}: InternVL's pixel shuffle needs "
                         "1 / downsample_ratio to be an integer (0.5, 0.25, ...)")
    return k


def tokens_per_tile(enc_cfg: EncoderConfig, proj_cfg: ProjectorConfig) -> int:
    """Image tokens per tile, ``(image_size / patch_size * downsample_ratio)**2``: the processor's
    ``image_seq_length`` (256 for 448-pixel tiles of 14-pixel patches at 0.5)."""
    side, k = tile_grid(enc_cfg), shuffle_factor(proj_cfg)
    if side % k:
        raise LoongError(f"projector.downsample_ratio={proj_cfg.downsample_ratio}: the tile's {side}x{side} patch "
                         f"grid (encoder.image_size / encoder.patch_size) does not divide by {k}")
    return (side // k) ** 2


def pixel_shuffle(x: torch.Tensor, k: int) -> torch.Tensor:
    """``[n, g, g, d] -> [n * (g/k)**2, k*k*d]``: each ``k x k`` block of patches becomes one token whose channels
    are the block's patches in row-major order, tokens in raster order (what HF's two view/permute steps do)."""
    n, g, _, d = x.shape
    x = x.reshape(n, g // k, k, g // k, k, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n * (g // k) ** 2, k * k * d)


def check_projector(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> None:
    """The config's own checks plus this family's: an integer shuffle factor dividing the tile grid, and no inner
    width other than the output (HF's projector maps straight to the foundation's width)."""
    check_config(proj_cfg, "projector")
    if proj_cfg.family != "internvl_mlp":
        raise LoongError(f"projector.family: {proj_cfg.family!r} given to the internvl_mlp builder")
    if proj_cfg.hidden_size not in (0, proj_cfg.out_hidden_size):
        raise LoongError(f"projector.hidden_size={proj_cfg.hidden_size}: InternVL's projector maps straight to "
                         f"the foundation's width; leave it 0 or set it to out_hidden_size="
                         f"{proj_cfg.out_hidden_size}")
    tokens_per_tile(enc_cfg, proj_cfg)


class InternVLProjector(nn.Module):
    """Pixel shuffle, then ``fc2(act(fc1(norm(x))))``: HF's ``InternVLMultiModalProjector`` (``layer_norm``,
    ``linear_1``, ``linear_2``) with its LayerNorm at torch's default epsilon (1e-5), as HF builds it.

    ``forward(out: EncoderOutput, grid_thw=None) -> ProjectorOutput(embeds [n_tiles * tokens_per_tile, out])``.
    """

    def __init__(self, proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> None:
        super().__init__()
        check_projector(proj_cfg, enc_cfg)
        out = proj_cfg.out_hidden_size
        self.k, self.side = shuffle_factor(proj_cfg), tile_grid(enc_cfg)
        width = enc_cfg.hidden_size * self.k * self.k
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, out)
        self.fc2 = nn.Linear(out, out)
        self.act = activation(proj_cfg.hidden_act, "projector.hidden_act")

    def forward(self, out: EncoderOutput, grid_thw: torch.Tensor | None = None) -> ProjectorOutput:
        h = out.hidden
        per_tile = self.side * self.side
        if h.dim() != 2 or h.shape[0] % per_tile:
            raise LoongError(f"internvl_mlp: encoder hidden {list(h.shape)} is not [n_tiles * {per_tile}, hidden] "
                             f"({self.side}x{self.side} patches per tile)")
        x = pixel_shuffle(h.reshape(-1, self.side, self.side, h.shape[-1]), self.k)
        return ProjectorOutput(embeds=self.fc2(self.act(self.fc1(self.norm(x)))))


# ------------------------------------------------------------------------------------ parameters and FLOPs

def encoder_num_parameters(cfg: EncoderConfig) -> int:
    """Analytic parameter count of :class:`InternVisionEncoder`."""
    d, f, side = cfg.hidden_size, cfg.intermediate_size, tile_grid(cfg)
    embed = (cfg.in_channels * cfg.patch_size ** 2 + 1) * d + d + (side * side + 1) * d
    norm = d if cfg.norm_type == "rms_norm" else 2 * d
    attn = 3 * d * d + (3 * d if cfg.qkv_bias else 0) + d * d + d + (2 * d if cfg.use_qk_norm else 0)
    block = 2 * norm + attn + 2 * d * f + f + d + 2 * d
    return embed + cfg.depth * block + (0 if cfg.use_mean_pooling else 2 * d)


def projector_num_parameters(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> int:
    """Analytic parameter count of :class:`InternVLProjector`."""
    width, out = enc_cfg.hidden_size * shuffle_factor(proj_cfg) ** 2, proj_cfg.out_hidden_size
    return 2 * width + width * out + out + out * out + out


def projector_flops_per_patch(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> float:
    """Forward FLOPs of the projector per encoder patch (one token per ``k x k`` patches)."""
    k2 = shuffle_factor(proj_cfg) ** 2
    width, out = enc_cfg.hidden_size * k2, proj_cfg.out_hidden_size
    return 2 * (width * out + out * out) / k2


def encoder_cost(cfg: EncoderConfig) -> VitCost:
    """``VitCost`` of one attention group of ``n`` tokens; a tile is one group of ``(S/P)**2 + 1`` tokens."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    linear = 2 * cfg.in_channels * cfg.patch_size ** 2 * d + cfg.depth * 2 * (3 * d * d + d * d + 2 * d * f)
    return VitCost(quadratic=float(attention_pair_flops(d) * cfg.depth), linear=float(linear))


def encoder_flops(cfg: EncoderConfig, n_tiles: list[int]) -> list[float]:
    """Forward FLOPs (matmuls, 2 per multiply-add) of the ViT for images of ``n_tiles`` tiles each (the
    processor's ``num_patches``): every tile attends over its ``(S/P)**2 + 1`` tokens alone."""
    cost, tokens = encoder_cost(cfg), tile_grid(cfg) ** 2 + 1
    # the CLS token runs through the blocks but not through the patch embedding
    per_tile = cost(tokens) - 2 * cfg.in_channels * cfg.patch_size ** 2 * cfg.hidden_size
    return [float(t * per_tile) for t in n_tiles]


__all__ = ["InternVLProjector", "InternVisionAttention", "InternVisionBlock", "InternVisionEncoder", "check_encoder",
           "check_projector", "encoder_cost", "encoder_flops", "encoder_num_parameters", "pixel_shuffle",
           "projector_flops_per_patch", "projector_num_parameters", "shuffle_factor", "tile_grid",
           "tokens_per_tile"]
