"""Ring attention: every rank of a ring group holds one contiguous chunk of the sequence; K/V travel round.

Ring rank ``r`` holds queries, keys and values of chunk ``r``. In ``R`` steps each rank computes its queries
against the K/V chunk it holds (:func:`~loong.core.attention.block.block_forward`, with the log-sum-exp), merges
the block into its running output by online softmax, and passes the K/V (and, for packed sequences, their document
ids) to ring rank ``r + 1`` while receiving from ``r - 1`` — the transfer of the next chunk overlaps the current
block. After ``R`` steps every query has seen every key; no rank ever holds more than two K/V chunks.

The backward is the standard ring-attention backward: the same K/V pass round once more, each block's gradients
are recomputed from the saved merged output and LSE (:func:`~loong.core.attention.block.block_backward`), ``dQ``
accumulates locally and ``dK``/``dV`` accumulators travel round the ring *with* their K/V chunk, arriving home
complete after one last hop. The gradients are exact (the sum of every block's share), not an approximation.

``causal=True`` keeps the contiguous chunking: chunk ``r`` attends fully to chunks ``< r``, causally to itself and
not at all to chunks ``> r`` (those steps only forward the K/V). This is correct but unbalanced (rank ``R - 1``
does ``R`` blocks, rank 0 one); megatron's zigzag split balances it and is not done here.

Transfers are ``torch.distributed`` point-to-point (``batch_isend_irecv``), so gloo on CPU and NCCL on GPU work.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from loong.core.attention.block import block_backward, block_forward, merge_blocks
from loong.core.attention.varlen import REFERENCE

_FULL, _DIAGONAL, _SKIP = "full", "diagonal", "skip"
#: P2P tags keep the K/V hop and the gradient hop apart where both are in flight between the same two ranks
_KV_TAG, _GRAD_TAG = 0, 1


class _Ring:
    """This rank's place in a ring group: its size, rank and the global ranks of its neighbours."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def mode(self, step: int, causal: bool) -> str:
        """How this rank's queries meet the K/V chunk it holds at ``step`` (chunk ``rank - step``)."""
        src = (self.rank - step) % self.size
        if not causal or src < self.rank:
            return _FULL
        return _DIAGONAL if src == self.rank else _SKIP

    def shift(self, tensors: list[torch.Tensor], tag: int) -> _Transfer:
        """Send ``tensors`` to the next rank and receive the previous rank's (same shapes); asynchronous."""
        return _Transfer(self, tensors, tag)


class _Transfer:
    """One hop round the ring in flight; :meth:`wait` returns what arrived."""

    def __init__(self, ring: _Ring, tensors: list[torch.Tensor], tag: int) -> None:
        if ring.size == 1:
            self.received, self.requests = tensors, []
            return
        self.sent = [t.contiguous() for t in tensors]  # kept alive until the sends complete
        self.received = [torch.empty_like(t) for t in self.sent]
        ops = [dist.P2POp(dist.isend, t, ring.next, ring.group, tag) for t in self.sent]
        ops += [dist.P2POp(dist.irecv, t, ring.prev, ring.group, tag) for t in self.received]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for req in self.requests:
            req.wait()
        return self.received


def _split(kv: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return kv[0], kv[1], kv[2] if len(kv) > 2 else None


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None,
                group: Any, causal: bool, scale: float, impl: str) -> torch.Tensor:
        ring = _Ring(group)
        kv = [k, v] + ([doc_ids] if doc_ids is not None else [])
        out = lse = None
        for step in range(ring.size):
            pending = ring.shift(kv, _KV_TAG) if step < ring.size - 1 else None
            mode = ring.mode(step, causal)
            if mode != _SKIP:  # step 0 is this rank's own chunk, never skipped: out is set there
                kk, vv, kd = _split(kv)
                block = block_forward(q, kk, vv, doc_ids, kd, causal=mode == _DIAGONAL, scale=scale, impl=impl)
                out, lse = block if out is None else merge_blocks(out, lse, *block)
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, doc_ids)
        ctx.group, ctx.causal, ctx.scale, ctx.impl = group, causal, scale, impl
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, doc_ids = ctx.saved_tensors
        ring = _Ring(ctx.group)
        kv = [k, v] + ([doc_ids] if doc_ids is not None else [])
        dq = torch.zeros_like(q, dtype=lse.dtype)
        # the dK/dV accumulators of the chunk this rank holds; they travel with it
        dk, dv = torch.zeros_like(k, dtype=lse.dtype), torch.zeros_like(v, dtype=lse.dtype)
        for step in range(ring.size):
            pending = ring.shift(kv, _KV_TAG) if step < ring.size - 1 else None
            mode = ring.mode(step, ctx.causal)
            if mode != _SKIP:
                kk, vv, kd = _split(kv)
                bq, bk, bv = block_backward(dout, q, kk, vv, out, lse, doc_ids, kd, causal=mode == _DIAGONAL,
                                            scale=ctx.scale, impl=ctx.impl)
                dq += bq
                dk += bk
                dv += bv
            # after the last step the hop brings this rank's own chunk's accumulators home, complete
            dk, dv = ring.shift([dk, dv], _GRAD_TAG).wait()
            if pending is not None:
                kv = pending.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *,
                   doc_ids: torch.Tensor | None = None, causal: bool = False, scale: float | None = None,
                   impl: str = REFERENCE) -> torch.Tensor:
    """Attention of this rank's sequence chunk over the whole sequence held round ``group``.

    ``q [b, h, s_c, d]``, ``k``/``v [b, h_kv, s_c, d(_v)]`` (grouped-query when ``h_kv < h``) are ring rank ``r``'s
    contiguous chunk ``r``; ``doc_ids [b, s_c]`` are its tokens' document ids (packed sequences; negative =
    padding, output 0). Returns ``[b, h, s_c, d_v]``, equal to full attention over the concatenated chunks, sliced.
    ``group`` None (or of size 1) is plain blockwise attention on one rank. ``impl``: ``reference`` or ``flex``
    (:mod:`loong.core.attention.varlen`); differentiable in ``q``, ``k``, ``v``.
    """
    if causal and k.shape[2] != q.shape[2]:
        raise ValueError(f"causal ring attention needs key chunks as long as query chunks: {k.shape[2]} != {q.shape[2]}")
    if doc_ids is not None and (doc_ids.shape != (q.shape[0], q.shape[2]) or k.shape[2] != q.shape[2]):
        raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must be [b, s_c] for queries and keys of {q.shape[2]} tokens")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, doc_ids, group, causal, scale, impl)


__all__ = ["ring_attention"]
