"""One Wan transformer block: modulated self-attention, cross-attention, modulated GELU-tanh feed-forward.

The timestep modulation is adaLN-zero style with a learned table: the block's ``modulation [1, 6, dim]`` plus the
timestep embedding's six vectors give shift/scale/gate for self-attention and for the feed-forward. A timestep per
token (Wan 2.2 TI2V) gives six vectors per token. Norms, modulation and the gated residual adds run in float32 and
are rounded to the activations' dtype once, as diffusers does, so that bf16 training rounds where Wan's does.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from loong.core.attention import CPGroups
from loong.diffusion.models.wan.attention import CrossAttention, SelfAttention
from loong.diffusion.models.wan.config import WanConfig
from loong.diffusion.models.wan.norms import LayerNorm32
from loong.kernels import Backend


class FeedForward(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x [..., dim]``."""
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def modulated(norm: LayerNorm32, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift`` in float32, rounded to ``x``'s dtype."""
    return (norm(x.float()) * (1 + scale) + shift).to(x.dtype)


class WanBlock(nn.Module):
    """Self-attention (RoPE, sharded tokens), cross-attention (text, + image for I2V), feed-forward."""

    def __init__(self, config: WanConfig, groups: CPGroups, capabilities: Collection[str],
                 norm_backend: Backend | None = None) -> None:
        super().__init__()
        d = config.dim
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)
        self.norm_attn = LayerNorm32(d, config.eps, affine=False)
        self.self_attn = SelfAttention(d, config.num_heads, config.eps, groups, capabilities, norm_backend)
        self.cross_norm = LayerNorm32(d, config.eps) if config.cross_attn_norm else None
        self.cross_attn = CrossAttention(d, config.num_heads, config.eps, groups, capabilities,
                                         image=config.image_dim is not None, norm_backend=norm_backend)
        self.norm_ffn = LayerNorm32(d, config.eps, affine=False)
        self.ffn = FeedForward(d, config.ffn_dim)

    def forward(self, x: torch.Tensor, text: torch.Tensor, image: torch.Tensor | None, modulation: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [b, s_local, dim]``; ``modulation [b, 6, dim]`` (one timestep a sample) or ``[b, s_local, 6, dim]``
        (one a token); ``cos``/``sin`` the rotary angles of this rank's tokens."""
        if modulation.ndim == 3:
            modulation = modulation.unsqueeze(1)  # one set for every token
        shift, scale, gate, ffn_shift, ffn_scale, ffn_gate = (self.modulation.unsqueeze(0)
                                                              + modulation.float()).unbind(2)
        x = (x.float() + self.self_attn(modulated(self.norm_attn, x, shift, scale), cos, sin) * gate).to(x.dtype)
        h = self.cross_norm(x) if self.cross_norm is not None else x
        x = x + self.cross_attn(h, text, image)
        h = modulated(self.norm_ffn, x, ffn_shift, ffn_scale)
        return (x.float() + self.ffn(h).float() * ffn_gate).to(x.dtype)


__all__ = ["FeedForward", "WanBlock", "modulated"]
