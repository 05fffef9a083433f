"""The one context-parallel attention entry point, :func:`cp_attention`, its process groups and the sequence split.

Context parallelism (CP) of size ``cp = ulysses × ring`` splits every sequence contiguously into ``cp`` shards;
CP rank ``c`` holds shard ``c`` (:func:`shard_sequence`). The CP ranks form a ``ring × ulysses`` grid with the
Ulysses index varying fastest::

    c = ring_rank · ulysses + ulysses_rank

so a Ulysses group (one ``ring_rank``) holds ``ulysses`` neighbouring shards — together, ring chunk ``ring_rank`` of
the sequence — and a ring group (one ``ulysses_rank``) holds the ring chunks ``0 .. ring - 1`` for one head slice.
Inside attention, the Ulysses all-to-all turns each rank's shard with all heads into its ring chunk with ``h/U``
heads, ring attention runs over the ring group, and the inverse all-to-all returns the output to the shard. Put the
Ulysses group on the fastest links (within a node): its all-to-all moves the activations, while the ring only
passes K/V between neighbours and overlaps that with compute.

Groups are passed explicitly (:class:`CPGroups`); nothing is stored in module state. Build them from a CP process
group (:func:`cp_groups_from_group`) or from a ``DeviceMesh`` (:func:`cp_groups_from_mesh`: a 1-D ``cp`` mesh, e.g.
``mesh["cp"]`` of the fsdp engine's ``("dp", "cp")`` mesh, is unflattened into ``("cp_ring", "cp_ulysses")``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loong.core.attention.ring import ring_attention
from loong.core.attention.ulysses import (
    all_gather_along,
    expand_kv_heads,
    group_rank,
    group_size,
    heads_to_seq,
    kv_head_repeat,
    local_heads,
    seq_to_heads,
)
from loong.core.attention.varlen import choose_varlen_impl, varlen_attention
from loong.core.errors import LoongError

#: the dimension names of the 2-D mesh :func:`cp_groups_from_mesh` builds (and accepts as it is)
MESH_DIMS = ("cp_ring", "cp_ulysses")


@dataclass(frozen=True)
class CPGroups:
    """The Ulysses and ring process groups of one CP rank; either may be None (size 1). ``CPGroups()`` is no
    context parallelism at all."""

    ulysses: Any = None
    ring: Any = None

    @property
    def ulysses_size(self) -> int:
        """Ranks in the Ulysses group (1 without one)."""
        return group_size(self.ulysses)

    @property
    def ring_size(self) -> int:
        """Ranks in the ring group (1 without one)."""
        return group_size(self.ring)

    @property
    def size(self) -> int:
        """The CP size, ``ulysses × ring``."""
        return self.ulysses_size * self.ring_size

    @property
    def rank(self) -> int:
        """This process's CP rank, ``ring_rank · ulysses + ulysses_rank``: the shard it holds."""
        return group_rank(self.ring) * self.ulysses_size + group_rank(self.ulysses)


def _check_sizes(cp: int, ulysses: int, ring: int) -> None:
    if ulysses < 1 or ring < 1 or ulysses * ring != cp:
        raise LoongError(f"context parallelism of {cp} ranks cannot be split as ulysses={ulysses} x ring={ring}; "
                         f"their product must be {cp}")


def cp_groups_from_group(cp_group: Any, ulysses: int, ring: int) -> CPGroups:
    """The Ulysses and ring sub-groups of ``cp_group`` (None: the whole world), CP rank ``c`` = its group rank.

    Collective over the default group: every process calls it with its own CP group (all CP groups of a job are
    the same size), because ``torch.distributed.new_group`` must see every sub-group on every rank.
    """
    ranks = list(range(dist.get_world_size())) if cp_group is None else dist.get_process_group_ranks(cp_group)
    _check_sizes(len(ranks), ulysses, ring)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    me = dist.get_rank()
    mine: dict[str, Any] = {"ulysses": None, "ring": None}
    for cp in sorted({tuple(r) for r in everyone}):  # the same order on every rank, as new_group needs
        subgroups = {"ulysses": [cp[r * ulysses:(r + 1) * ulysses] for r in range(ring)] if ulysses > 1 else [],
                     "ring": [cp[u::ulysses] for u in range(ulysses)] if ring > 1 else []}
        for kind, members_list in subgroups.items():
            for members in members_list:
                group = dist.new_group(list(members))
                if me in members:
                    mine[kind] = group
    return CPGroups(**mine)


def cp_groups_from_mesh(cp_mesh: Any, ulysses: int, ring: int) -> CPGroups:
    """The groups from a ``torch.distributed.device_mesh.DeviceMesh``: a 1-D mesh of the CP ranks (e.g. the
    ``cp`` dimension of an engine's ``("dp", "cp")`` mesh), unflattened into ``("cp_ring", "cp_ulysses")`` with
    CP rank ``c`` = its local rank on that dimension; or a 2-D mesh that already has those dimension names.

    Unflattening creates process groups: every rank of the mesh's root mesh must call it, with the same sizes.
    It uses ``DeviceMesh._unflatten`` (torch 2.9+), the mesh's own way to split a dimension.
    """
    names = tuple(cp_mesh.mesh_dim_names or ())
    if names != MESH_DIMS:
        if cp_mesh.ndim != 1:
            raise LoongError(f"cp_groups_from_mesh takes a 1-D CP mesh or a {MESH_DIMS} mesh, not {names or cp_mesh.ndim}")
        _check_sizes(cp_mesh.size(), ulysses, ring)
        cp_mesh = cp_mesh._unflatten(0, (ring, ulysses), MESH_DIMS)
    elif tuple(cp_mesh.shape) != (ring, ulysses):
        raise LoongError(f"a {MESH_DIMS} mesh of shape {tuple(cp_mesh.shape)} is not ring={ring} x ulysses={ulysses}")
    return CPGroups(ulysses=cp_mesh.get_group(MESH_DIMS[1]) if ulysses > 1 else None,
                    ring=cp_mesh.get_group(MESH_DIMS[0]) if ring > 1 else None)


def shard_sequence(x: torch.Tensor, groups: CPGroups, dim: int = 1) -> torch.Tensor:
    """This CP rank's contiguous shard of a whole sequence ``x`` along ``dim`` (length divisible by the CP size);
    differentiable (a view)."""
    size = groups.size
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise LoongError(f"a sequence of {x.shape[dim]} tokens does not split into {size} context-parallel shards; "
                         f"pad it to a multiple of {size}")
    return x.chunk(size, dim=dim)[groups.rank]


def gather_sequence(x: torch.Tensor, groups: CPGroups, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every CP rank's shard along ``dim`` (the inverse of :func:`shard_sequence`);
    not differentiable: for outputs, metrics and checks."""
    return all_gather_along(all_gather_along(x, groups.ulysses, dim), groups.ring, dim)


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_doc: torch.Tensor | None,
                     kv_doc: torch.Tensor | None, causal: bool, scale: float, impl: str) -> torch.Tensor:
    if q_doc is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return varlen_attention(q, k, v, q_doc, kv_doc_ids=kv_doc, causal=causal, scale=scale, impl=impl)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: CPGroups | None, *,
                 doc_ids: torch.Tensor | None = None, kv_doc_ids: torch.Tensor | None = None, causal: bool = False,
                 scale: float | None = None, kv_replicated: bool = False, capabilities: Collection[str] = (),
                 impl: str | None = None) -> torch.Tensor:
    """Attention of this CP rank's sequence shard over the whole (context-parallel) sequence.

    ``q [b, h, s/cp, d]`` is this rank's shard (:func:`shard_sequence`) with all heads. Self-attention:
    ``k``/``v [b, h_kv, s/cp, d(_v)]`` are the same shard's keys and values; ``doc_ids [b, s/cp]`` its document
    ids for packed sequences (negative = padding, output 0). ``kv_replicated=True`` is cross-attention to a short
    context every CP rank holds whole (a DiT's text tokens): ``k``/``v [b, h_kv, s_kv, d]`` are not sharded, only
    sliced by heads under Ulysses, and never sent; ``kv_doc_ids [b, s_kv]`` then go with ``doc_ids`` (both or
    neither). Under ``kv_replicated`` each rank's ``dk``/``dv`` hold its own queries' share: the replicated
    layers that produced K/V get the full gradient from the gradient reduction over CP ranks (as for any weight).

    Returns ``[b, h, s/cp, d_v]``, this shard's rows of full attention. ``causal`` (self-attention only) is
    supported; over a ring it is unbalanced (:mod:`loong.core.attention.ring`). The kernel is chosen from the
    accelerator's ``capabilities`` or by ``impl`` (:func:`~loong.core.attention.varlen.choose_varlen_impl`).
    Raises :class:`~loong.core.errors.LoongError` when the head counts do not split over the Ulysses size.
    """
    groups = groups or CPGroups()
    impl = choose_varlen_impl(capabilities, impl)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not divide into {k.shape[1]} key/value heads")
    repeat = kv_head_repeat(q.shape[1], k.shape[1], groups.ulysses_size)
    k, v = expand_kv_heads(k, repeat), expand_kv_heads(v, repeat)
    q_heads = seq_to_heads(q, groups.ulysses)
    q_doc = None if doc_ids is None else all_gather_along(doc_ids, groups.ulysses, 1)
    if kv_replicated:
        if causal:
            raise LoongError("kv_replicated is cross-attention to a replicated context, which has no causal order")
        if (doc_ids is None) != (kv_doc_ids is None):
            raise ValueError("cross-attention of packed samples needs both doc_ids and kv_doc_ids (or neither)")
        out = _local_attention(q_heads, local_heads(k, groups.ulysses), local_heads(v, groups.ulysses), q_doc,
                               kv_doc_ids, False, scale, impl)
    else:
        if kv_doc_ids is not None:
            raise ValueError("kv_doc_ids is for cross-attention (kv_replicated=True); self-attention uses doc_ids")
        k_heads, v_heads = seq_to_heads(k, groups.ulysses), seq_to_heads(v, groups.ulysses)
        if groups.ring_size == 1:
            out = _local_attention(q_heads, k_heads, v_heads, q_doc, None, causal, scale, impl)
        else:
            out = ring_attention(q_heads, k_heads, v_heads, groups.ring, doc_ids=q_doc, causal=causal, scale=scale,
                                 impl=impl)
    return heads_to_seq(out, groups.ulysses)


__all__ = ["MESH_DIMS", "CPGroups", "cp_attention", "cp_groups_from_group", "cp_groups_from_mesh", "gather_sequence",
           "shard_sequence"]
