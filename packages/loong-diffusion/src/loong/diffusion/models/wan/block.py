"""One Wan transformer block: modulated self-attention, cross-attention, modulated GELU-tanh feed-forward.

The timestep modulation is adaLN-zero style with a learned table: the block's ``modulation [1, 6, dim]`` plus the
timestep embedding's six vectors give shift/scale/gate for self-attention and for the feed-forward. A timestep per
token (Wan 2.2 TI2V) gives six vectors per token. Norms, modulation and the gated residual adds run in float32 and
are rounded to the activations' dtype once, as diffusers does, so that bf16 training rounds where Wan's does.
A packed sequence of several clips takes the modulation of each token's own timestep (:mod:`.modulation`) and
attends within each clip.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from loong.core.attention import CPGroups
from loong.diffusion.models.wan.attention import CrossAttention, SelfAttention
from loong.diffusion.models.wan.config import WanConfig
from loong.diffusion.models.wan.modulation import indexed_affine
from loong.diffusion.models.wan.norms import LayerNorm32
from loong.kernels import Backend


class PackedDocs(NamedTuple):
    """Which clip each token of this CP rank (``doc_ids [1, s_local]``, -1 = padding), each text token
    (``text_doc_ids [1, s_text]``) and each image token (``image_doc_ids``, or None) of a packed sequence belongs
    to, and each token's row of the timestep table (``timestep_index [s_local]``)."""

    doc_ids: torch.Tensor
    text_doc_ids: torch.Tensor
    image_doc_ids: torch.Tensor | None
    timestep_index: torch.Tensor


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
                 kernel_backend: Backend | None = None) -> None:
        super().__init__()
        d = config.dim
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)
        self.norm_attn = LayerNorm32(d, config.eps, affine=False)
        self.self_attn = SelfAttention(d, config.num_heads, config.eps, groups, capabilities, kernel_backend)
        self.cross_norm = LayerNorm32(d, config.eps) if config.cross_attn_norm else None
        self.cross_attn = CrossAttention(d, config.num_heads, config.eps, groups, capabilities,
                                         image=config.image_dim is not None, kernel_backend=kernel_backend)
        self.norm_ffn = LayerNorm32(d, config.eps, affine=False)
        self.ffn = FeedForward(d, config.ffn_dim)

    def forward(self, x: torch.Tensor, text: torch.Tensor, image: torch.Tensor | None, modulation: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, packed: PackedDocs | None = None) -> torch.Tensor:
        """``x [b, s_local, dim]``; ``modulation [b, 6, dim]`` (one timestep a sample) or ``[b, s_local, 6, dim]``
        (one a token); ``cos``/``sin`` the rotary angles of this rank's tokens. A packed sequence (``packed``) has
        ``modulation [K, 6, dim]``, one row per distinct timestep, picked per token by ``packed.timestep_index``."""
        if packed is not None:
            return self._forward_packed(x, text, image, modulation, cos, sin, packed)
        if modulation.ndim == 3:
            modulation = modulation.unsqueeze(1)  # one set for every token
        shift, scale, gate, ffn_shift, ffn_scale, ffn_gate = (self.modulation.unsqueeze(0)
                                                              + modulation.float()).unbind(2)
        x = (x.float() + self.self_attn(modulated(self.norm_attn, x, shift, scale), cos, sin) * gate).to(x.dtype)
        h = self.cross_norm(x) if self.cross_norm is not None else x
        x = x + self.cross_attn(h, text, image)
        h = modulated(self.norm_ffn, x, ffn_shift, ffn_scale)
        return (x.float() + self.ffn(h).float() * ffn_gate).to(x.dtype)

    def _forward_packed(self, x: torch.Tensor, text: torch.Tensor, image: torch.Tensor | None,
                        modulation: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        packed: PackedDocs) -> torch.Tensor:
        """:meth:`forward` of a packed sequence ``x [1, s_local, dim]``: the same float32 arithmetic per token, each
        token with its timestep's row of the modulation table, attention within each clip."""
        index = packed.timestep_index
        shift, scale, gate, ffn_shift, ffn_scale, ffn_gate = (self.modulation[0] + modulation.float()).unbind(1)
        h = indexed_affine(self.norm_attn(x.float()), 1 + scale, shift, index).to(x.dtype)
        attn = self.self_attn(h, cos, sin, packed.doc_ids)
        x = (x.float() + indexed_affine(attn, gate, None, index)).to(x.dtype)
        h = self.cross_norm(x) if self.cross_norm is not None else x
        x = x + self.cross_attn(h, text, image, packed.doc_ids, packed.text_doc_ids, packed.image_doc_ids)
        h = indexed_affine(self.norm_ffn(x.float()), 1 + ffn_scale, ffn_shift, index).to(x.dtype)
        return (x.float() + indexed_affine(self.ffn(h).float(), ffn_gate, None, index)).to(x.dtype)


__all__ = ["FeedForward", "PackedDocs", "WanBlock", "modulated"]
