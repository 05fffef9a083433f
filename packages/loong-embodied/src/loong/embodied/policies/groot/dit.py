"""GR00T's diffusion transformer (DiT) and VL self-attention transformer, as plain modules.

Facts (shapes, formulas, parameter names) follow lerobot 0.6.1's ``groot/action_head/cross_attention_dit.py``
and Isaac-GR00T's ``gr00t/model/modules/dit.py``, which build these blocks from diffusers pieces; this file
writes the same arithmetic without diffusers. Parameter names are the published checkpoints' (``to_q``,
``to_out.0``, ``ff.net.0.proj``, ``norm1.linear``, ``transformer_blocks.N``...), so GR00T weights load by prefix.

One DiT block (``TransformerBlock``)::

    x = x + Dropout(Attn(AdaLN(x, temb), context))     # cross-attention to the VL tokens, or self-attention
    x = x + FF(LayerNorm(x))                           # GELU(tanh) MLP, 4x wide

Even blocks cross-attend to the VL tokens; odd blocks self-attend (``interleave_self_attention``). The
"alternate" variant (N1.6 / N1.7) masks the cross-attention of even blocks to the text tokens in every
``2 * attend_text_every_n_blocks``-th block and to the image tokens in the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loong.core.errors import LoongError


def timestep_features(timesteps: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """``[b, dim]`` ``[cos | sin]`` features of discretised timesteps ``[b]`` (diffusers' ``Timesteps`` with
    ``flip_sin_to_cos=True, downscale_freq_shift=1``: frequencies ``exp(-ln(1e4) * i / (dim/2 - 1))``)."""
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    freqs = timesteps[:, None].float() * torch.exp(exponent / (half - 1))[None, :]
    return torch.cat([torch.cos(freqs), torch.sin(freqs)], dim=-1)


class TimestepEmbedder(nn.Module):
    """``Linear(256, d) -> SiLU -> Linear(d, d)`` (diffusers' ``TimestepEmbedding`` names)."""

    def __init__(self, in_channels: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimestepEncoder(nn.Module):
    """Discretised flow time ``[b]`` -> conditioning vector ``temb`` ``[b, dim]``."""

    frequency_dim = 256

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(self.frequency_dim, dim)

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        dtype = self.timestep_embedder.linear_1.weight.dtype
        return self.timestep_embedder(timestep_features(timesteps, self.frequency_dim).to(dtype))


class AdaLayerNorm(nn.Module):
    """``LayerNorm(x) * (1 + scale) + shift`` with ``scale, shift = Linear(SiLU(temb))`` (no affine weights)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    """Multi-head attention: queries from ``x``, keys/values from ``context`` (cross) or ``x`` (self).

    ``mask`` ``[b, s_kv]`` bool: True = attend. Scaled by ``head_dim ** -0.5`` (SDPA's default).
    """

    def __init__(self, dim: int, heads: int, head_dim: int, *, context_dim: int | None = None, bias: bool = True,
                 out_bias: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.to_q = nn.Linear(dim, inner, bias=bias)
        self.to_k = nn.Linear(context_dim or dim, inner, bias=bias)
        self.to_v = nn.Linear(context_dim or dim, inner, bias=bias)
        self.to_out = nn.Sequential(nn.Linear(inner, dim, bias=out_bias), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        b = x.shape[0]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, -1, self.heads, self.head_dim).transpose(1, 2)

        attn_mask = None if mask is None else mask[:, None, None, :].to(torch.bool)
        out = F.scaled_dot_product_attention(heads(self.to_q(x)), heads(self.to_k(context)),
                                             heads(self.to_v(context)), attn_mask=attn_mask)
        return self.to_out(out.transpose(1, 2).reshape(b, -1, self.heads * self.head_dim))


class GeluProjection(nn.Module):
    """``GELU_tanh(Linear(x))`` (diffusers' ``GELU(approximate="tanh")``: the weight is ``proj``)."""

    def __init__(self, dim_in: int, dim_out: int, bias: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """``Linear(d, 4d) -> GELU(tanh) -> Dropout -> Linear(4d, d) [-> Dropout]`` as ``net.0 .. net.3``."""

    def __init__(self, dim: int, *, dropout: float = 0.0, final_dropout: bool = False, mult: int = 4,
                 bias: bool = True) -> None:
        super().__init__()
        inner = dim * mult
        layers: list[nn.Module] = [GeluProjection(dim, inner, bias), nn.Dropout(dropout),
                                   nn.Linear(inner, dim, bias=bias)]
        if final_dropout:
            layers.append(nn.Dropout(dropout))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """One pre-norm attention + MLP block (diffusers' ``BasicTransformerBlock`` as GR00T configures it).

    ``ada_norm=True`` (DiT): ``norm1`` is an :class:`AdaLayerNorm` on ``temb`` and ``norm3`` has no affine
    weights; ``ada_norm=False`` (VL self-attention): both are affine LayerNorms. ``context_dim`` set: ``attn1``
    cross-attends to a context of that width.
    """

    def __init__(self, dim: int, heads: int, head_dim: int, *, context_dim: int | None = None,
                 ada_norm: bool = True, norm_affine: bool = False, norm_eps: float = 1e-5, dropout: float = 0.0,
                 final_dropout: bool = True, attention_bias: bool = True) -> None:
        super().__init__()
        self.ada_norm = ada_norm
        self.is_cross_attention = context_dim is not None
        self.norm1 = AdaLayerNorm(dim) if ada_norm else nn.LayerNorm(dim, eps=norm_eps,
                                                                      elementwise_affine=norm_affine)
        self.attn1 = Attention(dim, heads, head_dim, context_dim=context_dim, bias=attention_bias, dropout=dropout)
        self.norm3 = nn.LayerNorm(dim, eps=norm_eps, elementwise_affine=norm_affine)
        self.ff = FeedForward(dim, dropout=dropout, final_dropout=final_dropout)
        # diffusers applies the block's own dropout to the attention output when final_dropout is set
        self.final_dropout = nn.Dropout(dropout) if final_dropout else None

    def forward(self, x: torch.Tensor, *, temb: torch.Tensor | None = None, context: torch.Tensor | None = None,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x, temb) if self.ada_norm else self.norm1(x)
        h = self.attn1(h, context, context_mask if context is not None else None)
        if self.final_dropout is not None:
            h = self.final_dropout(h)
        x = x + h
        return x + self.ff(self.norm3(x))


@dataclass
class DiTConfig:
    """The DiT's shape (GR00T's ``diffusion_model_cfg`` plus the VL width and the alternate-VL switch).

    ``num_attention_heads * attention_head_dim`` is the DiT width (``input_embedding_dim`` of the action head);
    ``output_dim`` is what the action decoder reads (the head's ``hidden_size``); ``cross_attention_dim`` is the
    VL token width (``backbone_embedding_dim``).
    """

    num_layers: int = 32
    num_attention_heads: int = 32
    attention_head_dim: int = 48
    output_dim: int = 1024
    cross_attention_dim: int = 2048
    dropout: float = 0.2
    final_dropout: bool = True
    attention_bias: bool = True
    norm_eps: float = 1e-5
    interleave_self_attention: bool = True
    use_alternate_vl_dit: bool = True
    attend_text_every_n_blocks: int = 2

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


class DiT(nn.Module):
    """Flow-matching denoiser: state+action tokens ``[b, t, inner]`` attend to VL tokens, conditioned on time.

    Output: ``[b, t, output_dim]`` after the final AdaLN-style modulation (``proj_out_1`` -> shift, scale) and
    ``proj_out_2``.
    """

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        if config.use_alternate_vl_dit and not config.interleave_self_attention:
            raise LoongError("dit: use_alternate_vl_dit=true needs interleave_self_attention=true")
        self.config = config
        dim = config.inner_dim
        self.timestep_encoder = TimestepEncoder(dim)
        self.transformer_blocks = nn.ModuleList(
            TransformerBlock(dim, config.num_attention_heads, config.attention_head_dim,
                             context_dim=None if self._is_self_attention(i) else config.cross_attention_dim,
                             ada_norm=True, norm_affine=False, norm_eps=config.norm_eps, dropout=config.dropout,
                             final_dropout=config.final_dropout, attention_bias=config.attention_bias)
            for i in range(config.num_layers))
        self.norm_out = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.proj_out_1 = nn.Linear(dim, 2 * dim)
        self.proj_out_2 = nn.Linear(dim, config.output_dim)

    def _is_self_attention(self, index: int) -> bool:
        return self.config.interleave_self_attention and index % 2 == 1

    def context_masks(self, vl_mask: torch.Tensor | None,
                      image_mask: torch.Tensor | None) -> list[torch.Tensor | None]:
        """The key mask each block's cross-attention uses (None: self-attention, or no mask).

        The plain DiT attends to every VL token unmasked (GR00T passes no mask there); the alternate DiT needs
        ``vl_mask`` (valid tokens) and ``image_mask`` (image tokens), both ``[b, s]`` bool.
        """
        if not self.config.use_alternate_vl_dit:
            return [None] * len(self.transformer_blocks)
        if vl_mask is None or image_mask is None:
            raise LoongError("dit: the alternate VL DiT needs vl_mask and image_mask")
        image_keys = image_mask & vl_mask
        text_keys = (~image_mask) & vl_mask
        period = 2 * self.config.attend_text_every_n_blocks
        return [None if self._is_self_attention(i) else (text_keys if i % period == 0 else image_keys)
                for i in range(len(self.transformer_blocks))]

    def forward(self, x: torch.Tensor, vl_tokens: torch.Tensor, timesteps: torch.Tensor, *,
                vl_mask: torch.Tensor | None = None, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[b, t, inner]``, ``vl_tokens`` ``[b, s, cross_attention_dim]``, ``timesteps`` ``[b]`` (long,
        in ``[0, num_timestep_buckets)``) -> ``[b, t, output_dim]``."""
        temb = self.timestep_encoder(timesteps)
        masks = self.context_masks(vl_mask, image_mask)
        for i, block in enumerate(self.transformer_blocks):
            if self._is_self_attention(i):
                x = block(x, temb=temb)
            else:
                x = block(x, temb=temb, context=vl_tokens, context_mask=masks[i])
        shift, scale = self.proj_out_1(F.silu(temb)).chunk(2, dim=1)
        return self.proj_out_2(self.norm_out(x) * (1 + scale[:, None]) + shift[:, None])


@dataclass
class SelfAttentionConfig:
    """The VL self-attention transformer's shape (GR00T's ``vl_self_attention_cfg``); ``num_layers=0``: none."""

    num_layers: int = 4
    num_attention_heads: int = 32
    attention_head_dim: int = 64
    dropout: float = 0.2
    final_dropout: bool = True
    attention_bias: bool = True

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


class SelfAttentionTransformer(nn.Module):
    """A stack of affine-LayerNorm self-attention blocks over the VL tokens (no mask, no time)."""

    def __init__(self, config: SelfAttentionConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer_blocks = nn.ModuleList(
            TransformerBlock(config.inner_dim, config.num_attention_heads, config.attention_head_dim,
                             ada_norm=False, norm_affine=True, dropout=config.dropout,
                             final_dropout=config.final_dropout, attention_bias=config.attention_bias)
            for _ in range(config.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.transformer_blocks:
            x = block(x)
        return x


__all__ = [
    "AdaLayerNorm",
    "Attention",
    "DiT",
    "DiTConfig",
    "FeedForward",
    "SelfAttentionConfig",
    "SelfAttentionTransformer",
    "TimestepEncoder",
    "TransformerBlock",
    "timestep_features",
]
