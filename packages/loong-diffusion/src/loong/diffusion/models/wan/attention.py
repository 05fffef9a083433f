"""The two attentions of a Wan block, both through ``loong.core.attention.cp_attention``: self-attention over the
(context-parallel sharded) video tokens with 3-D RoPE, and cross-attention to the text tokens (plus, for Wan 2.1
I2V, to the CLIP image tokens through their own K/V projections), which every CP rank holds whole. A packed
sequence (several clips in one) passes document ids: both attentions are then varlen, each clip attending within
itself and to its own text and image tokens.

q and k are RMS-normalised over all heads together before the heads are split, as Wan does; under Ulysses that
happens before the all-to-all, while each rank still holds every head of its tokens, so it needs no communication.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from loong.core.attention import CPGroups, cp_attention
from loong.diffusion.models.wan.norms import RMSNorm
from loong.diffusion.models.wan.rope import rotate_qk
from loong.kernels import Backend


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, s, heads * d]`` → SDPA's ``[b, heads, s, d]``."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[b, heads, s, d]`` → ``[b, s, heads * d]``."""
    return x.transpose(1, 2).flatten(2)


class SelfAttention(nn.Module):
    """Full (non-causal) self-attention of the video tokens; q, k, v from one fused projection."""

    def __init__(self, dim: int, heads: int, eps: float, groups: CPGroups, capabilities: Collection[str],
                 kernel_backend: Backend | None = None) -> None:
        super().__init__()
        self.heads, self.groups, self.capabilities = heads, groups, capabilities
        self.kernel_backend = kernel_backend
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = RMSNorm(dim, eps, kernel_backend)
        self.k_norm = RMSNorm(dim, eps, kernel_backend)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``x [b, s_local, dim]``, this CP rank's tokens; ``cos``/``sin`` their rotary angles; ``doc_ids [b,
        s_local]`` their clips in a packed sequence (varlen attention within each clip; -1 = padding)."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = rotate_qk(split_heads(self.q_norm(q), self.heads), split_heads(self.k_norm(k), self.heads), cos, sin,
                         self.kernel_backend)
        out = cp_attention(q, k, split_heads(v, self.heads), self.groups, doc_ids=doc_ids,
                           capabilities=self.capabilities)
        return self.out(merge_heads(out))


class CrossAttention(nn.Module):
    """Attention of the video tokens to the text tokens; with ``image_dim`` also to the image tokens (a second
    softmax over their own normalised keys, added to the text attention's output before the output projection)."""

    def __init__(self, dim: int, heads: int, eps: float, groups: CPGroups, capabilities: Collection[str],
                 image: bool = False, kernel_backend: Backend | None = None) -> None:
        super().__init__()
        self.heads, self.groups, self.capabilities = heads, groups, capabilities
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.q_norm = RMSNorm(dim, eps, kernel_backend)
        self.k_norm = RMSNorm(dim, eps, kernel_backend)
        self.image_kv = nn.Linear(dim, 2 * dim) if image else None
        self.image_k_norm = RMSNorm(dim, eps, kernel_backend) if image else None
        self.out = nn.Linear(dim, dim)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None,
                kv_doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return cp_attention(q, split_heads(k, self.heads), split_heads(v, self.heads), self.groups,
                            doc_ids=doc_ids, kv_doc_ids=kv_doc_ids, kv_replicated=True,
                            capabilities=self.capabilities)

    def forward(self, x: torch.Tensor, text: torch.Tensor, image: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, text_doc_ids: torch.Tensor | None = None,
                image_doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``x [b, s_local, dim]``; ``text [b, s_text, dim]`` and ``image [b, s_image, dim]`` whole on every rank.
        A packed sequence gives the clip of each query (``doc_ids [b, s_local]``), text token (``text_doc_ids
        [b, s_text]``) and image token (``image_doc_ids``): each clip attends to its own condition only."""
        q = split_heads(self.q_norm(self.q(x)), self.heads)
        k, v = self.kv(text).chunk(2, dim=-1)
        out = self._attend(q, self.k_norm(k), v, doc_ids, text_doc_ids)
        if self.image_kv is not None and self.image_k_norm is not None and image is not None:
            k_img, v_img = self.image_kv(image).chunk(2, dim=-1)
            out = out + self._attend(q, self.image_k_norm(k_img), v_img, doc_ids, image_doc_ids)
        return self.out(merge_heads(out))


__all__ = ["CrossAttention", "SelfAttention", "merge_heads", "split_heads"]
