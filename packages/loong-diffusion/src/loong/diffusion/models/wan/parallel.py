"""A differentiable gather of context-parallel sequence shards, for a model output that every CP rank uses whole.

``loong.core.attention.gather_sequence`` is not differentiable (it serves metrics and checks). When every CP rank
computes the *same* loss from the gathered whole output, the gradient arriving at the gather is the same on every
rank, and this rank's shard of it is exactly the gradient of its own output tokens; the parameter gradients of the
CP ranks then sum (not average) to the whole sequence's gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from loong.core.attention import CPGroups, gather_sequence, shard_sequence


class _GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: CPGroups, dim: int) -> torch.Tensor:
        ctx.groups, ctx.dim = groups, dim
        return gather_sequence(x, groups, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return shard_sequence(grad, ctx.groups, ctx.dim).contiguous(), None, None


def gather_shards(x: torch.Tensor, groups: CPGroups, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every CP rank's shard ``x`` along ``dim``; the backward keeps this rank's shard of
    the gradient (correct when every rank computes the same loss from the result, see the module docstring)."""
    if groups.size == 1:
        return x
    return _GatherShards.apply(x.contiguous(), groups, dim)


__all__ = ["gather_shards"]
