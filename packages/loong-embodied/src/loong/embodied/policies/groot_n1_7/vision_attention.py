"""One attention call for all the images of a batch in transformers' Qwen3-VL vision tower.

transformers' ``Qwen3VLVisionAttention`` runs attention image by image (``torch.split`` of the packed tokens by
``cu_seqlens``, one SDPA call each) unless its config names a flash-attention implementation, which receives the
packed tokens with ``cu_seqlens`` in one call. A GR00T batch of 32 samples with two cameras is 64 images, so the
published 24-layer tower launched about 1,600 small attention kernels per step, which left the H200 idle most of
a GR00T N1.7 step (``benchmarks/results/vla_throughput_h200_profile_groot_ddp_20261202.json``, docs/embodied.md).

:data:`IMPLEMENTATION` is registered through transformers' own extension point (``AttentionInterface.register``)
and set on the vision tower's config only. Its name contains "flash" because that is how transformers decides to
pass ``cu_seqlens`` (``transformers.utils.generic.is_flash_attention_requested``). When every image has the same
number of tokens (one camera resolution: the usual case) it is a single batched SDPA over ``[images, heads, tokens,
dim]``; otherwise it falls back to one call per image, as transformers does. Both compute softmax attention within
each image and nothing across images, so the result is transformers' own up to floating-point summation order.

``max_length_q`` is the host integer transformers passes on (``max_seqlen``): GR00T N1.7's policy gives the tower
its images' length, known from the shapes (:func:`.precompute.max_image_patches`), so the batched path reads
nothing back from the device; without it, transformers reads it from ``cu_seqlens`` (a device read).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: the attention implementation's name in transformers' registry (see the module docstring for the "flash")
IMPLEMENTATION = "loong_flash_varlen_image_sdpa"


def image_batched_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None = None, scaling: float | None = None,
                            dropout: float = 0.0, cu_seq_lens_q: torch.Tensor | None = None,
                            max_length_q: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention within each image of packed ``query/key/value [1, heads, tokens, dim]`` (images delimited by
    ``cu_seq_lens_q``); returns ``([1, tokens, heads, dim], None)``, the layout transformers' implementations
    return."""
    _, heads, total, dim = query.shape
    if cu_seq_lens_q is None:  # one sequence (e.g. a single image): plain attention
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling)
        return out.transpose(1, 2), None
    images = cu_seq_lens_q.numel() - 1
    longest = int(max_length_q) if max_length_q is not None else int(cu_seq_lens_q.diff().max())
    if longest * images == total:  # every image has `longest` tokens (they sum to `total`)
        def per_image(x: torch.Tensor) -> torch.Tensor:
            return x.view(heads, images, longest, dim).transpose(0, 1)

        out = F.scaled_dot_product_attention(per_image(query), per_image(key), per_image(value), dropout_p=dropout,
                                             scale=scaling)  # [images, heads, longest, dim]
        return out.transpose(1, 2).reshape(1, total, heads, dim), None
    lengths = cu_seq_lens_q.diff().tolist()
    outs = [F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling)
            for q, k, v in zip(*(x.split(lengths, dim=2) for x in (query, key, value)), strict=True)]
    return torch.cat(outs, dim=2).transpose(1, 2), None


def use_image_batched_attention(vision_tower: nn.Module) -> None:
    """Register :func:`image_batched_attention` with transformers (idempotent) and make ``vision_tower`` (a
    ``Qwen3VLVisionModel``) use it; the text decoder keeps its own implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, image_batched_attention)
    vision_tower.config._attn_implementation = IMPLEMENTATION
