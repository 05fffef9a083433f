"""Plain-PyTorch references for DeepSeek sparse attention (DSA): the lightning indexer and sparse MLA.

These are the oracles the Triton kernels are tested against, and the fallback on CPU. They favour clarity
and fp32 accuracy over memory: ``indexer_scores_reference`` builds the full ``[B, S, S]`` score matrix and
``sparse_mla_attention_reference`` gathers the selected kv rows into a ``[B, S, K, D]`` fp32 tensor.
"""

from __future__ import annotations

import torch


def _check_indexer(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 3 or weights.dim() != 3:
        raise ValueError(f"indexer: expected q [B, S, H_I, D_I], k [B, S_k, D_I], weights [B, S, H_I]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, weights {tuple(weights.shape)}")
    b, s, h, d = q.shape
    if k.shape[0] != b or k.shape[2] != d or k.shape[1] < s or tuple(weights.shape) != (b, s, h):
        raise ValueError(f"indexer: expected k [{b}, S_k >= {s}, {d}] and weights {(b, s, h)} for q "
                         f"{tuple(q.shape)}; got k {tuple(k.shape)}, weights {tuple(weights.shape)}")


def indexer_scores_reference(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, *,
                             scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """Lightning-indexer scores ``I[b, t, s] = sum_j w[b, t, j] * relu(scale * q[b, t, j] . k[b, s])``.

    This is transformers' ``DeepseekV32Indexer`` math: ``scale`` defaults to ``D_I ** -0.5`` and is applied
    inside the ReLU; ``weights`` are used as given (Hugging Face multiplies ``weights_proj``'s output by
    ``H_I ** -0.5`` before this point, so pass weights that already carry that factor).

    Args:
        q: indexer queries ``[B, S, H_I, D_I]`` (after RoPE), any float dtype.
        k: the one shared indexer key per token ``[B, S_k, D_I]``, ``S_k >= S``: the queries are the sequence's
            last ``S`` positions (``S_k - S + t`` for query ``t``; context parallelism passes a chunk's queries).
        weights: per-head weights ``[B, S, H_I]``.
        scale: the factor inside the ReLU (default ``D_I ** -0.5``).
        causal: mask keys after the query (``s > S_k - S + t``).

    Returns:
        ``[B, S, S_k]`` float32 scores, ``-inf`` where masked. Differentiable w.r.t. ``q``, ``k`` and
        ``weights`` (the indexer's training loss goes through it); memory is ``O(S^2)``, one head at a time.
    """
    _check_indexer(q, k, weights)
    s_len, n_heads, d, s_k = q.shape[1], q.shape[2], q.shape[3], k.shape[1]
    scale = d ** -0.5 if scale is None else float(scale)
    qf, kf, wf = q.float(), k.float(), weights.float()
    kt = kf.transpose(1, 2)
    scores = None
    # One head at a time keeps the peak at two [B, S, S] buffers instead of [B, S, H_I, S].
    for j in range(n_heads):
        term = torch.relu(torch.matmul(qf[:, :, j], kt) * scale) * wf[:, :, j, None]
        scores = term if scores is None else scores + term
    if scores is None:
        scores = qf.new_zeros(q.shape[0], s_len, s_k)
    if causal:
        future = torch.ones(s_len, s_k, dtype=torch.bool, device=q.device).triu_(1 + s_k - s_len)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def topk_from_scores(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-``topk`` key indices per query from ``[B, S, S_k]`` scores, sorted by score (descending).

    Masked keys (``-inf``) are never selected; their slots, and any slots past ``S_k``, hold ``-1``.
    """
    b, s, s_k = scores.shape
    n = min(topk, s_k)
    out = torch.full((b, s, topk), -1, dtype=torch.int32, device=scores.device)
    if n > 0:
        vals, idx = scores.topk(n, dim=-1)
        out[..., :n] = idx.to(torch.int32).masked_fill(vals == float("-inf"), -1)
    return out


def indexer_topk_reference(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *,
                           scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """``indexer_topk`` in plain PyTorch: full scores, then ``torch.topk``. ``[B, S, topk]`` int32, -1 padded."""
    if topk < 1:
        raise ValueError(f"indexer_topk: topk must be >= 1, got {topk}")
    with torch.no_grad():
        return topk_from_scores(indexer_scores_reference(q, k, weights, scale=scale, causal=causal), topk)


def check_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, v_dim: int) -> None:
    """Shape and dtype checks shared by the kernel and the reference (ValueError for both paths)."""
    if q.dim() != 4 or kv.dim() != 3 or indices.dim() != 3:
        raise ValueError(f"sparse_mla_attention: expected q [B, S, H, D_qk], kv [B, S_kv, D_qk], indices "
                         f"[B, S, K]; got q {tuple(q.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)}")
    b, s, _, d = q.shape
    if kv.shape[0] != b or kv.shape[2] != d:
        raise ValueError(f"sparse_mla_attention: kv has shape {tuple(kv.shape)}, expected ({b}, S_kv, {d})")
    if indices.shape[:2] != (b, s):
        raise ValueError(f"sparse_mla_attention: indices has shape {tuple(indices.shape)}, expected ({b}, {s}, K)")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_mla_attention: indices must be int32 or int64, got {indices.dtype}")
    if not 0 < v_dim <= d:
        raise ValueError(f"sparse_mla_attention: v_dim must be in [1, D_qk={d}], got {v_dim}")
    if q.dtype != kv.dtype:
        raise ValueError(f"sparse_mla_attention: q is {q.dtype} but kv is {kv.dtype}")


def sparse_mla_attention_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *,
                                   softmax_scale: float, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention (MQA mode) in plain PyTorch: gather the selected kv rows, masked softmax.

    Query ``(b, t, h)`` attends to the keys ``kv[b, indices[b, t, :]]`` (all ``D_qk`` channels); the value
    of a key is its first ``v_dim`` channels. Index entries outside ``[0, S_kv)`` (``-1`` by convention)
    are ignored; a query with no valid key gets output 0 and ``lse = -inf``. The indices are not checked
    for causality or duplicates (a duplicated index counts twice, as in the kernel).

    Args:
        q: ``[B, S, H, D_qk]`` queries.
        kv: ``[B, S_kv, D_qk]``, one shared latent key/value per token.
        indices: ``[B, S, K]`` int32 (or int64) selected token positions, ``-1`` for none.
        softmax_scale: factor on ``q . k`` before the softmax.
        v_dim: the value width (the first ``v_dim`` channels of kv).

    Returns:
        ``(out [B, S, H, v_dim]`` in q's dtype, ``lse [B, S, H]`` float32, natural log, no gradient``)``.
        The math is fp32; gradients flow to ``q`` and ``kv``.
    """
    check_attention(q, kv, indices, v_dim)
    b, s, h, d = q.shape
    s_kv, n_sel = kv.shape[1], indices.shape[2]
    valid = (indices >= 0) & (indices < s_kv)  # [B, S, K]
    safe = torch.where(valid, indices.long(), torch.zeros((), dtype=torch.long, device=indices.device))
    # One gathered copy serves as both keys (all channels) and values (a prefix), so it is saved once.
    sel = kv.gather(1, safe.reshape(b, s * n_sel, 1).expand(-1, -1, d)).reshape(b, s, n_sel, d).float()
    scores = torch.matmul(q.float(), sel.transpose(-1, -2)) * softmax_scale  # [B, S, H, K]
    mask = valid[:, :, None, :]
    any_valid = valid.any(-1)[:, :, None]  # [B, S, 1]
    # Rows without a valid key are filled with zeros, not -inf, so softmax and its gradient stay finite;
    # multiplying by the mask afterwards makes them contribute nothing.
    filled = scores.masked_fill(~mask, float("-inf")).masked_fill(~any_valid[..., None], 0.0)
    probs = torch.softmax(filled, dim=-1) * mask
    lse = torch.logsumexp(filled, dim=-1).masked_fill(~any_valid, float("-inf"))
    # Multiply by the whole row and slice after: slicing ``sel`` first would make a strided copy of it.
    out = torch.matmul(probs, sel)[..., :v_dim]
    return out.to(q.dtype), lse.detach()
