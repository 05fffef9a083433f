"""Per-token modulation from a small table: what a packed sequence's tokens need, each taking its timestep's
shift, scale and gate.

:func:`indexed_affine` applies a ``[K, dim]`` table to each token by its row index without keeping an
``[tokens, dim]`` copy of the gathered rows for the backward (a plain ``table[index]`` product keeps one per
modulated product, about four extra activations a block at 32K tokens); its backward sums per row with a one-hot
matrix product, deterministic where ``index_add_`` on CUDA is not.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class _IndexedAffine(torch.autograd.Function):
    """``x * scale[index] + shift[index]``, saving only ``x`` and the small tables for the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None,
                index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, scale, index)
        ctx.has_shift = shift is not None
        out = x * scale[index]
        return out + shift[index] if shift is not None else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, scale, index = ctx.saved_tensors
        grad_x = grad_scale = grad_shift = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad * scale[index]).to(x.dtype)
        if ctx.needs_input_grad[1] or (ctx.has_shift and ctx.needs_input_grad[2]):
            # [K, s] one-hot rows: the per-entry sums of the batch-summed per-token gradients, as one matmul
            onehot = F.one_hot(index, scale.shape[0]).to(grad.dtype).t()
            if ctx.needs_input_grad[1]:
                grad_scale = (onehot @ (grad * x).sum(0)).to(scale.dtype)
            if ctx.has_shift and ctx.needs_input_grad[2]:
                grad_shift = (onehot @ grad.sum(0)).to(scale.dtype)
        return grad_x, grad_scale, grad_shift, None


def indexed_affine(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None,
                   index: torch.Tensor) -> torch.Tensor:
    """``x [b, s, d] * scale[index] + shift[index]`` with ``scale``/``shift [K, d]`` and ``index [s]`` (each token's
    row of the tables; ``shift`` None: no shift), in the promoted dtype of ``x`` and the tables."""
    return _IndexedAffine.apply(x, scale, shift, index)


__all__ = ["indexed_affine"]
