"""Wan's 3-D rotary position embedding: each head's channels split into a frame, a row and a column part, each
rotated by that axis's index of the token.

The angles come from the tokens' ``(frame, row, column)`` positions, not from a table over a fixed-length
sequence, so a context-parallel shard rotates by its own *global* positions (``shard_sequence`` of
:func:`grid_positions`) and a packed sequence could give each clip its own grid.
"""

from __future__ import annotations

import torch

from loong.diffusion.models.wan.config import ROPE_THETA
from loong.kernels import Backend


def grid_positions(frames: int, height: int, width: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[frames * height * width, 3]`` (frame, row, column) of each token of a patch grid, in the model's token
    order (frames outermost, columns innermost: how a patch embedding's output is flattened)."""
    axes = [torch.arange(n, device=device) for n in (frames, height, width)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)


def rope_angles(positions: torch.Tensor, dims: tuple[int, int, int],
                theta: float = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each ``[tokens, sum(dims) / 2]`` float32, for ``positions [tokens, 3]``.

    Axis ``a`` owns ``dims[a]`` channels, that is ``dims[a] / 2`` channel pairs with frequencies
    ``theta^(-2j / dims[a])``. Angles are computed in float64 and rounded once to float32, as diffusers does, so
    the tables equal its precomputed ones bit for bit.
    """
    parts = []
    for axis, dim in enumerate(dims):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
        parts.append(positions[:, axis].to(torch.float64)[:, None] * freqs[None])
    angles = torch.cat(parts, dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, tokens, head_dim]`` by the angles of each token (``cos``/``sin [tokens, head_dim/2]``).

    Wan rotates *adjacent* channel pairs ``(2j, 2j+1)`` (not the two halves of the head, as LLaMA does). The
    rotation runs in float32 and is rounded back to ``x``'s dtype once.
    """
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              backend: Backend | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope` of ``q`` and ``k`` (``[b, heads, tokens, head_dim]``); with a loong-kernels ``backend``
    both in one fused launch of its interleaved-pair RoPE (the same fp32 arithmetic, rounded once)."""
    if backend is None:
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    from loong.kernels import apply_rope as fused_rope

    q, k = fused_rope(q, k, cos, sin, layout="bhsd", interleaved=True, backend=backend)
    return q, k  # type: ignore[return-value]


__all__ = ["apply_rope", "grid_positions", "rope_angles", "rotate_qk"]
