"""DeepSpeed-Ulysses sequence parallelism: trade the sequence shard for a head shard around attention.

Each of the ``U`` ranks of a Ulysses group holds a contiguous sequence shard of q/k/v with all heads,
``[b, h, s/U, d]``. One ``all_to_all_single`` (:func:`seq_to_heads`) gives every rank the whole sequence for
``h/U`` heads, ``[b, h/U, s, d]``; attention then runs locally (heads are independent), and the inverse
all-to-all (:func:`heads_to_seq`) returns the output to sequence shards. Both are autograd functions whose backward
is the other all-to-all, so the gradients land on the shards that produced the inputs.

Rank ``u`` gets heads ``u·h/U .. (u+1)·h/U - 1``. Grouped-query K/V (``h_kv < h``) split the same way when ``h_kv``
divides by ``U``; when ``h_kv < U`` (and ``U`` divides by ``h_kv``) each K/V head is first repeated ``U / h_kv``
times (:func:`expand_kv_heads`), so that every rank holds the one K/V head its query heads read — the all-to-all
then moves ``U / h_kv`` times the K/V it would need at best, the price of fewer K/V heads than ranks. Head counts
that fit neither way are a :class:`~loong.core.errors.LoongError`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from loong.core.errors import LoongError


def group_size(group: Any) -> int:
    """The size of ``group``; 1 for None."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's rank in ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def kv_head_repeat(heads: int, kv_heads: int, ulysses: int) -> int:
    """How many times each K/V head is repeated before the all-to-all (1: not at all); fails when the head
    counts cannot be split over ``ulysses`` ranks."""
    if heads % ulysses:
        raise LoongError(f"Ulysses sequence parallelism over {ulysses} ranks splits the attention heads, but "
                         f"{heads} query heads do not divide by {ulysses}; choose a Ulysses size that divides {heads}")
    if kv_heads % ulysses == 0:
        return 1
    if ulysses % kv_heads == 0:
        return ulysses // kv_heads
    raise LoongError(f"Ulysses sequence parallelism over {ulysses} ranks splits the key/value heads, but {kv_heads} "
                     f"is neither a multiple nor a divisor of {ulysses}; choose a Ulysses size that divides "
                     f"{kv_heads} or is a multiple of it")


def expand_kv_heads(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """``[b, h_kv, s, d]`` -> ``[b, h_kv·repeat, s, d]``, each head repeated in place (autograd sums the copies'
    gradients back)."""
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=1)


def _all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Piece ``i`` of ``x`` along ``scatter_dim`` goes to rank ``i``; the pieces received are concatenated along
    ``gather_dim`` in rank order."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim))  # [size, ...], contiguous: row i for rank i
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[b, h, s/U, d]`` (this rank's sequence shard, all heads) -> ``[b, h/U, s, d]`` (the whole sequence, this
    rank's heads). Differentiable; the identity for a group of one."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, 1, 2)


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[b, h/U, s, d]`` -> ``[b, h, s/U, d]``."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, 2, 1)


def local_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's heads of a tensor every rank holds whole, ``[b, h, s, d]`` -> ``[b, h/U, s, d]`` (no
    communication: cross-attention to a replicated context)."""
    size = group_size(group)
    return x if size == 1 else x.chunk(size, dim=1)[group_rank(group)]


@torch.no_grad()
def all_gather_along(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order (not differentiable: for document ids and for
    outputs)."""
    if group_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


__all__ = ["all_gather_along", "expand_kv_heads", "group_rank", "group_size", "heads_to_seq", "kv_head_repeat",
           "local_heads", "seq_to_heads"]
