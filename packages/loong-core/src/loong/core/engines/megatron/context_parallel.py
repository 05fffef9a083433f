"""Context parallelism without Transformer Engine: the zigzag sequence split and all-gather causal attention.

With ``parallel.cp = N`` every sequence is cut into ``2N`` equal chunks and CP rank ``r`` keeps chunks ``r`` and
``2N - 1 - r`` (megatron-core's layout, which its rotary embedding assumes: ``get_pos_emb_on_this_cp_rank``). Under
a causal mask an early chunk attends to few keys and a late one to many, so every rank gets the same attention work.

Attention then gathers the keys and values of the whole sequence from the CP group (all-gather forward,
reduce-scatter backward, so every query's gradient reaches the rank that owns the key) and each local chunk attends
to the keys up to its own end. This is Llama 3's all-gather context parallelism: with grouped-query attention the
gathered K/V are small next to the queries, and the attention kernel stays the stock one (SDPA). Transformer
Engine's ring attention, where installed, is used instead through megatron-core's TE spec.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def cp_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk numbers (of ``2 * cp_size``) that CP rank ``cp_rank`` holds, earlier first."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_for_cp_rank(t: torch.Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``seq_dim`` (its length must divide by ``2 * cp_size``)."""
    if cp_size == 1:
        return t
    seq = t.shape[seq_dim]
    if seq % (2 * cp_size):
        raise ValueError(f"sequence length {seq} is not divisible by 2 * cp = {2 * cp_size}")
    chunks = t.chunk(2 * cp_size, dim=seq_dim)
    a, b = cp_chunks(cp_size, cp_rank)
    return torch.cat([chunks[a], chunks[b]], dim=seq_dim)


def sum_over_cp(count: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """``count`` (e.g. a rank's token count) summed over the CP group, detached: the whole sequences' count that a
    CP-split loss divides by. Unchanged without a group or with a group of one."""
    if cp_group is None or cp_group.size() == 1:
        return count
    import torch.distributed as dist

    count = count.detach().clone()
    dist.all_reduce(count, group=cp_group)
    return count


def gather_sequence(x: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """``x [s_local, ...]`` (this rank's two chunks) -> ``[s, ...]``, the whole sequence in order.

    Differentiable: the backward reduce-scatters, so each rank gets the summed gradient of its own chunks.
    """
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    cp = cp_group.size()
    gathered = gather_from_sequence_parallel_region(x.contiguous(), tensor_parallel_output_grad=True, group=cp_group)
    half = x.shape[0] // 2
    # rank-major [r0: c0, c_{2N-1} | r1: c1, c_{2N-2} | ...] -> chunk order c0 .. c_{2N-1}
    order = [(c, 0) if c < cp else (2 * cp - 1 - c, 1) for c in range(2 * cp)]
    return torch.cat([gathered[(r * 2 + h) * half:(r * 2 + h + 1) * half] for r, h in order], dim=0)


def gather_rows(rows: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """This rank's two zigzag chunks of batch rows ``[b, s_local, ...]`` (document ids, per-token losses) -> the
    whole rows ``[b, s, ...]`` in order. Not differentiable (see :func:`gather_sequence` for activations)."""
    import torch.distributed as dist

    local = rows.transpose(0, 1).contiguous()  # the sequence dim first, as the chunks are cut
    parts = [torch.empty_like(local) for _ in range(cp_group.size())]
    dist.all_gather(parts, local, group=cp_group)
    cp, half = cp_group.size(), local.shape[0] // 2
    order = [(c, 0) if c < cp else (2 * cp - 1 - c, 1) for c in range(2 * cp)]
    return torch.cat([parts[r][h * half:(h + 1) * half] for r, h in order], dim=0).transpose(0, 1)


def causal_attention_cp(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp_group: Any, *,
                        scale: float, dropout_p: float = 0.0, document_ids: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    ``query [s_local, b, h, d]``, ``key``/``value [s_local, b, h_kv, d(_v)]`` hold this rank's two zigzag chunks;
    returns ``[s_local, b, h, d_v]``. Equal (up to rounding) to causal attention on the unsplit sequence, sliced.
    ``document_ids [b, s_local]`` (this rank's chunks of packed rows; negative = padding, whose output is 0) keep
    every document to itself: each chunk then attends through a boolean ``[b, 1, s/(2 cp), end]`` mask (same
    document and not in the future), the one place this path materialises a mask.
    """
    from torch.nn.attention.bias import causal_lower_right

    cp, rank = cp_group.size(), cp_group.rank()
    k_all, v_all = gather_sequence(key, cp_group), gather_sequence(value, cp_group)
    docs_all = gather_rows(document_ids, cp_group) if document_ids is not None else None
    groups = query.shape[2] // key.shape[2]
    if groups > 1:  # the fused SDPA kernels take a lower-right causal bias, but not with grouped K/V heads
        k_all, v_all = (t.repeat_interleave(groups, dim=2) for t in (k_all, v_all))
    half = query.shape[0] // 2
    outs = []
    for part, chunk in enumerate(cp_chunks(cp, rank)):
        end = (chunk + 1) * half  # this chunk sees every key before its own end
        q = query[part * half:(part + 1) * half].permute(1, 2, 0, 3)  # [b, h, L, d]
        k, v = (t[:end].permute(1, 2, 0, 3) for t in (k_all, v_all))
        # query i sits at chunk * half + i and attends to keys 0 .. chunk * half + i: the causal mask aligned to
        # the bottom-right corner, which SDPA applies without materialising it
        if docs_all is None:
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(half, end),
                                                       dropout_p=dropout_p, scale=scale))
            continue
        q_docs = document_ids[:, part * half:(part + 1) * half]  # [b, L]
        q_pos = torch.arange(chunk * half, end, device=q.device)
        allowed = (q_docs[:, :, None] == docs_all[:, None, :end]) & (q_pos[:, None] >= torch.arange(
            end, device=q.device)[None, :])  # padding rows see the other padding before them: finite, then 0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], dropout_p=dropout_p, scale=scale)
        outs.append(out * (q_docs >= 0)[:, None, :, None].to(out.dtype))
    return torch.cat(outs, dim=2).permute(2, 0, 1, 3)


__all__ = ["causal_attention_cp", "cp_chunks", "gather_rows", "gather_sequence", "split_for_cp_rank", "sum_over_cp"]
