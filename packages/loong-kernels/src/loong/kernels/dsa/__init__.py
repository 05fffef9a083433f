"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): the lightning indexer's top-k and sparse MLA attention.

- :func:`indexer_topk` picks, per query token, the ``topk`` keys with the highest lightning-indexer score
  ``I[t, s] = sum_j w[t, j] * relu(scale * q[t, j] . k[s])``. The Triton kernel walks the keys in chunks and
  keeps a running top-k per query, so the ``S x S`` score matrix never exists.
- :func:`sparse_mla_attention` is MLA in MQA mode over those keys: every head of a query attends to the
  same selected latent rows ``kv[indices]``; the value is the first ``v_dim`` channels of the same row.
  The Triton forward tiles heads so that one gathered kv tile serves a whole block of heads; the backward
  adds the kv gradient into an fp32 buffer with atomics.

Each comes with its plain-PyTorch reference (``*_reference``), and ``backend`` picks as in the rest of
``loong.kernels``. See ``docs/kernels.md`` ("DeepSeek sparse attention").
"""

from __future__ import annotations

import torch

from loong.kernels._dispatch import Backend, check_float, use_triton
from loong.kernels.dsa import attention as _attention
from loong.kernels.dsa import indexer as _indexer
from loong.kernels.dsa.reference import (
    _check_indexer,
    check_attention,
    indexer_scores_reference,
    indexer_topk_reference,
    sparse_mla_attention_reference,
)

__all__ = [
    "indexer_scores_reference",
    "indexer_topk",
    "indexer_topk_reference",
    "sparse_mla_attention",
    "sparse_mla_attention_reference",
]


def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *,
                 scale: float | None = None, causal: bool = True, backend: Backend = "auto") -> torch.Tensor:
    """The ``topk`` highest-scoring keys per query under DeepSeek-V3.2's lightning indexer (no gradient).

    Args:
        q: indexer queries ``[B, S, H_I, D_I]`` (after RoPE), fp32/bf16/fp16.
        k: the shared indexer key per token ``[B, S_k, D_I]``, same dtype as ``q``; ``S_k >= S``: the queries are
            the last ``S`` positions (bottom-right causal alignment, for a context-parallel chunk of queries).
        weights: per-head weights ``[B, S, H_I]`` (any float dtype; used as given, see
            :func:`indexer_scores_reference` for the scaling convention).
        topk: keys to keep per query (2048 in V3.2).
        scale: the factor inside the ReLU, default ``D_I ** -0.5`` (transformers' ``softmax_scale``).
        causal: only keys ``s <= S_k - S + t`` are eligible.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Returns:
        ``[B, S, topk]`` int32 key positions, best first; slots with no eligible key (fewer than ``topk`` keys
        under the causal mask) hold ``-1`` at the end of the row. The selected *set* equals the reference's
        up to ties between equal scores.
    """
    _check_indexer(q, k, weights)
    if topk < 1:
        raise ValueError(f"indexer_topk: topk must be >= 1, got {topk}")
    why = (check_float("indexer_topk", q, "q") or check_float("indexer_topk", weights, "weights")
           or _indexer.why_not(q, k, weights, topk))
    if not use_triton(backend, "indexer_topk", (q, k, weights), why):
        return indexer_topk_reference(q, k, weights, topk, scale=scale, causal=causal)
    return _indexer.indexer_topk_triton(q, k, weights, topk, scale=scale, causal=causal)


def sparse_mla_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, softmax_scale: float,
                         v_dim: int, backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention over indexer-selected tokens (MQA: all heads share one latent kv per token).

    Args:
        q: ``[B, S, H, D_qk]`` (576 = 512 latent + 64 rope in V3.2), fp32/bf16/fp16.
        kv: ``[B, S_kv, D_qk]`` latent keys; the values are their first ``v_dim`` channels. Same dtype as q.
        indices: ``[B, S, K]`` int32 (or int64) token positions into kv; ``-1`` (anything outside
            ``[0, S_kv)``) marks an empty slot. Causality is the indexer's job: indices are used as given.
        softmax_scale: factor on ``q . k`` before the softmax.
        v_dim: value width (512 in V3.2).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Returns:
        ``out [B, S, H, v_dim]`` in q's dtype and ``lse [B, S, H]`` float32 (natural-log log-sum-exp of the
        scaled scores; ``-inf`` and output 0 for a query with no valid key). Gradients flow to ``q`` and
        ``kv``; ``lse`` carries none.
    """
    check_attention(q, kv, indices, v_dim)
    why = check_float("sparse_mla_attention", q, "q") or _attention.why_not(q, kv, indices, v_dim)
    if not use_triton(backend, "sparse_mla_attention", (q, kv, indices), why):
        return sparse_mla_attention_reference(q, kv, indices, softmax_scale=softmax_scale, v_dim=v_dim)
    return _attention.sparse_mla_attention_triton(q, kv, indices, softmax_scale=softmax_scale, v_dim=v_dim)
