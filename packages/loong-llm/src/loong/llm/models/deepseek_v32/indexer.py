"""DeepSeek-V3.2's lightning indexer and its training loss (DeepSeek-V3.2-Exp tech report, section 2.1).

- :class:`LightningIndexer` holds transformers' ``DeepseekV32Indexer`` weights (``wq_b`` from the normed q latent,
  ``wk`` + LayerNorm ``k_norm`` from the layer input, ``weights_proj``) and returns the indexer's ``q [B, S, H_I,
  D_I]``, ``k [B, S, D_I]`` and head weights ``w [B, S, H_I]``, with RoPE (half-split, *not* interleaved as MLA's) on
  the first ``qk_rope_head_dim`` channels and ``w`` already times ``H_I ** -0.5``: exactly what
  ``loong.kernels.dsa.indexer_topk`` takes, ``I[t, s] = sum_j w[t, j] relu(D_I^-0.5 q[t, j] . k[s])``.
- :func:`attention_mass` + :func:`normalise_target` give the loss target ``p_t``: the main attention's probabilities
  over the attended keys, summed over heads (head groups, then all TP ranks' heads) and L1-normalised, recomputed
  exactly from the attention's ``lse``.
- :func:`indexer_kl` is ``mean_t KL(p_t || softmax(I_t))`` over the same keys (all causal keys in the dense warm-up,
  the selected ``S_t`` in the sparse stage).
- :class:`IndexerLossAutoScaler` adds ``indexer_loss_coeff`` × that loss to the gradient the way megatron's
  ``MoEAuxLossAutoScaler`` adds the MoE aux loss (the pipeline schedule sets its scale through
  ``TransformerConfig.experimental_attention_variant_loss_scale_func``); :func:`indexer_loss_report` gives the
  logged ``indexer_loss``.

Both the target and the indexer scores are computed query-chunk by query-chunk (``c`` picked so that a chunk holds at
most ``_CHUNK_ELEMENTS`` floats), so no ``S x S x H`` tensor exists; the indexer-score chunks are recomputed in the
backward (``torch.utils.checkpoint``) rather than saved. How a chunk is scored depends on how many keys each query
attends (:func:`_gathers`): in the sparse stage (``K`` keys of ``S``, ``K <= S / 2``) the attended keys' rows are
gathered and only those ``K`` dot products are taken, ``[B, c, K, D]`` per chunk — at 64K tokens and top-k 2048 that is
32x less work than scoring every key; in the dense warm-up (``K = S``) a chunk is scored against every key (``[B, c,
H, S]``) and then gathered. Both give the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

# floats per chunk of [B, c, heads, S] scores: 2**26 fp32 = 256 MiB
_CHUNK_ELEMENTS = 1 << 26


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE (transformers' ``rotate_half``) on the first ``cos.shape[-1]`` channels of ``x``."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
    rotated = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated.to(x.dtype), rest), dim=-1)


class LightningIndexer(torch.nn.Module):
    """The lightning indexer's weights and projections (replicated on every tensor-parallel rank).

    Why replicated: it is small (``q_lora_rank·H_I·D_I + d·(D_I + H_I)``, 0.13B of 671B in V3.2) and every rank
    needs the scores of every query anyway for its heads' top-k; each TP rank computes the same loss on the same
    inputs, so the gradients are equal and need no TP reduction (the weights carry no ``sequence_parallel`` mark).
    """

    def __init__(self, config: Any, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int) -> None:
        super().__init__()
        d, dtype = config.hidden_size, config.params_dtype
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.wq_b = torch.nn.Linear(q_lora_rank, n_heads * head_dim, bias=False, dtype=dtype)
        self.wk = torch.nn.Linear(d, head_dim, bias=False, dtype=dtype)
        self.k_norm = torch.nn.LayerNorm(head_dim, eps=1e-6, dtype=dtype)  # transformers: eps fixed at 1e-6
        self.weights_proj = torch.nn.Linear(d, n_heads, bias=False, dtype=dtype)
        for lin in (self.wq_b, self.wk, self.weights_proj):
            config.init_method(lin.weight)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [S, B, d]`` (the attention input), ``q_latent [S, B, q_lora_rank]`` (MLA's normed q latent),
        ``cos``/``sin`` ``[S, 1, 1, rope_dim]`` (half-split layout, YaRN's mscale included) ->
        ``(q [B, S, H_I, D_I], k [B, S, D_I], w [B, S, H_I] fp32)``."""
        s, b = x.shape[:2]
        q = self.wq_b(q_latent).view(s, b, self.n_heads, self.head_dim)
        q = rotate_half_rope(q, cos, sin)
        k = rotate_half_rope(self.k_norm(self.wk(x)).unsqueeze(2), cos, sin).squeeze(2)
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        return q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(), w.transpose(0, 1).contiguous()


def dense_causal_indices(batch: int, seq: int, device: torch.device, n_keys: int | None = None) -> torch.Tensor:
    """``[B, S, n_keys]`` int32 (``n_keys`` defaults to ``S``): query ``t``, at position ``n_keys - S + t`` (the
    sequence's last ``S`` positions: a context-parallel chunk), lists keys ``0..`` its position, then ``-1`` (every
    causal key, for dense attention)."""
    n_keys = seq if n_keys is None else n_keys
    keys = torch.arange(n_keys, device=device, dtype=torch.int32)
    pos = torch.arange(n_keys - seq, n_keys, device=device, dtype=torch.int32)
    idx = torch.where(keys[None, :] <= pos[:, None], keys[None, :], torch.full_like(keys, -1)[None, :])
    return idx.unsqueeze(0).expand(batch, -1, -1).contiguous()


def _chunk(batch: int, heads: int, seq: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, batch * heads * seq))


def _gathers(n_keys: int, seq_kv: int) -> bool:
    """Whether to score only each query's ``n_keys`` attended keys (gathering their rows) rather than every key:
    a gathered key costs a row copy besides its dot product, so it pays once at most half the keys are attended."""
    return 2 * n_keys <= seq_kv


def _rows_at(x: torch.Tensor, safe: torch.Tensor) -> torch.Tensor:
    """``x [B, S, D]`` at ``safe [B, c, K]`` (valid positions) -> ``[B, c, K, D]`` (differentiable)."""
    b, c, k = safe.shape
    return x.gather(1, safe.reshape(b, c * k, 1).expand(-1, -1, x.shape[-1])).view(b, c, k, x.shape[-1])


def _valid_positions(indices: torch.Tensor, seq_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``indices`` (``-1`` = none) -> (positions with empty slots at 0 as int64, valid mask)."""
    valid = (indices >= 0) & (indices < seq_kv)
    return torch.where(valid, indices.long(), torch.zeros((), dtype=torch.long, device=indices.device)), valid


def _gather_keys(scores: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores [..., S_kv]`` at ``indices [..., K]`` (``-1`` = none): (values, valid mask)."""
    safe, valid = _valid_positions(indices, scores.shape[-1])
    return scores.gather(-1, safe), valid


@torch.no_grad()
def normalise_target(mass: torch.Tensor, tp_group: Any = None) -> torch.Tensor:
    """The indexer's target ``p [B, S, K]`` (fp32, rows sum to 1): :func:`attention_mass` summed over the
    tensor-parallel ranks' heads (all-reduced over ``tp_group``), L1-normalised per query."""
    if tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(mass, group=tp_group)
    return mass / mass.sum(dim=-1, keepdim=True).clamp_min(1e-20)


@torch.no_grad()
def attention_mass(query: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor,
                   softmax_scale: float) -> torch.Tensor:
    """``[B, S, K]`` fp32: the attention probabilities of ``query``'s heads at ``indices``, summed over those heads
    (unnormalised, so head groups add up: :func:`normalise_target` finishes the target).

    ``query [B, S, H, D]`` and ``kv [B, S_kv, D]`` are the (absorbed, MQA-form) attention inputs and ``lse [B, S, H]``
    the attention's log-sum-exp, so ``exp(scale·q·k - lse)`` is each head's exact probability."""
    b, s, h, d = query.shape
    n_keys, seq_kv = indices.shape[-1], kv.shape[1]
    out = torch.zeros(indices.shape, dtype=torch.float32, device=query.device)
    gathered = _gathers(n_keys, seq_kv)
    step = _chunk(b, max(h, d), n_keys) if gathered else _chunk(b, h, seq_kv)
    kv_t = None if gathered else kv.float().transpose(1, 2)
    for t0 in range(0, s, step):
        t1 = min(s, t0 + step)
        q_c = query[:, t0:t1].float()
        if gathered:  # [B, c, H, K]: each query's heads against its own K keys
            safe, valid = _valid_positions(indices[:, t0:t1], seq_kv)
            sel = torch.matmul(q_c, _rows_at(kv, safe).float().transpose(-1, -2)) * softmax_scale
            valid = valid[:, :, None, :]
        else:  # [B, c, H, S_kv] against every key, then gathered
            scores = torch.matmul(q_c, kv_t[:, None]) * softmax_scale
            sel, valid = _gather_keys(scores, indices[:, t0:t1, None, :].expand(-1, -1, h, -1))
        lse_c = lse[:, t0:t1, :, None]
        probs = torch.exp(sel - lse_c).masked_fill(~valid | ~torch.isfinite(lse_c), 0.0)
        out[:, t0:t1] = probs.sum(dim=2)
    return out


def indexer_scores_at(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Differentiable indexer scores ``I [B, c, K]`` of queries ``q [B, c, H_I, D_I]`` (weights ``w [B, c, H_I]``)
    at keys ``indices [B, c, K]`` of ``k [B, S, D_I]``; ``-inf`` at empty slots. Same math as
    ``loong.kernels.dsa.indexer_scores_reference`` (scale ``D_I ** -0.5`` inside the ReLU)."""
    scale = q.shape[-1] ** -0.5
    if _gathers(indices.shape[-1], k.shape[1]):  # [B, c, H_I, K]: each query against its own K keys
        safe, valid = _valid_positions(indices, k.shape[1])
        per_head = torch.relu(torch.matmul(q.float(), _rows_at(k, safe).float().transpose(-1, -2)) * scale)
        sel = (per_head * w.float()[..., None]).sum(dim=2)
    else:  # [B, c, H_I, S] against every key, then gathered
        per_head = torch.relu(torch.matmul(q.float(), k.float().transpose(1, 2)[:, None]) * scale)
        sel, valid = _gather_keys((per_head * w.float()[..., None]).sum(dim=2), indices)
    return sel.masked_fill(~valid, float("-inf"))


def _kl_rows(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, indices: torch.Tensor,
             target: torch.Tensor) -> torch.Tensor:
    """Sum over the chunk's rows of ``KL(target || softmax(I))`` over each row's valid keys."""
    scores = indexer_scores_at(q, k, w, indices)
    valid = torch.isfinite(scores)
    # a row with no valid key (none in causal attention: every query sees itself) contributes 0, not NaN
    logp = torch.log_softmax(scores.masked_fill(~valid.any(-1, keepdim=True), 0.0), dim=-1)
    terms = torch.xlogy(target, target) - target * logp.masked_fill(~valid, 0.0)
    return terms.masked_fill(~valid, 0.0).sum()


def indexer_kl(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, indices: torch.Tensor,
               target: torch.Tensor) -> torch.Tensor:
    """``mean_t KL(target_t || softmax_s(I[t, s]))`` over the keys ``indices [B, S, K]`` (fp32 scalar).

    Gradients reach ``q``, ``k`` and ``w`` (the indexer); ``target`` is a constant. Each query chunk's scores are
    recomputed in the backward instead of saved, so memory stays at one chunk's (``[B, c, H_I, K]`` with the gathered
    ``[B, c, K, D_I]`` key rows, or ``[B, c, H_I, S]`` when every key is scored: :func:`_gathers`).
    """
    b, s = indices.shape[:2]
    n_keys, seq_kv = indices.shape[-1], k.shape[1]
    step = _chunk(b, max(q.shape[2], q.shape[3]), n_keys) if _gathers(n_keys, seq_kv) else _chunk(b, q.shape[2], seq_kv)
    total = q.new_zeros((), dtype=torch.float32)
    for t0 in range(0, s, step):
        sl = slice(t0, min(s, t0 + step))
        args = (q[:, sl], k, w[:, sl], indices[:, sl], target[:, sl])
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or w.requires_grad):
            total = total + checkpoint(_kl_rows, *args, use_reentrant=False)
        else:
            total = total + _kl_rows(*args)
    return total / (b * s)


class IndexerLossAutoScaler(torch.autograd.Function):
    """Identity on an activation whose backward also sends ``scale`` into the indexer loss (megatron's
    ``MoEAuxLossAutoScaler`` pattern: the loss joins the gradient without changing the returned LM loss)."""

    main_loss_backward_scale: torch.Tensor | None = None

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        (loss,) = ctx.saved_tensors
        scale = IndexerLossAutoScaler.main_loss_backward_scale
        scale = torch.ones((), device=loss.device) if scale is None else scale.to(loss.device)
        return grad_output, torch.ones_like(loss) * scale

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Called by megatron's schedule each micro-batch (``1 / num_microbatches`` × the grad scale)."""
        IndexerLossAutoScaler.main_loss_backward_scale = scale.detach().clone()


# --- logging ----------------------------------------------------------------------------------------------
# The per-step sum of every DSA layer's (unweighted) indexer loss over this rank's micro-batches, and the number of
# (layer, micro-batch) terms in it.
_TRACKER: dict[str, Any] = {"sum": None, "terms": 0}


def record_indexer_loss(loss: torch.Tensor) -> None:
    """Add one layer's indexer loss (one micro-batch) to the step's log."""
    value = loss.detach().float().reshape(1)
    _TRACKER["sum"] = value if _TRACKER["sum"] is None else _TRACKER["sum"] + value
    _TRACKER["terms"] += 1


def clear_indexer_loss_tracker() -> None:
    """Forget what :func:`record_indexer_loss` collected."""
    _TRACKER["sum"], _TRACKER["terms"] = None, 0


def indexer_loss_report(pg_collection: Any, device: torch.device) -> dict[str, float]:
    """``{"indexer_loss": mean over DSA layers, micro-batches and data-parallel ranks}`` for the step, then clears.

    Collective over the pipeline, data- and context-parallel groups (every rank must call it): pipeline stages hold
    different layers, so their sums and term counts are added; a CP rank's term is its queries' mean, and every CP
    rank holds as many queries, so the mean over CP ranks is the sequences'; gloo has no AVG, so the mean is taken
    here.
    """
    stats = torch.zeros(2, dtype=torch.float64, device=device)
    if _TRACKER["sum"] is not None:
        stats[0], stats[1] = float(_TRACKER["sum"]), float(_TRACKER["terms"])
    clear_indexer_loss_tracker()
    if dist.is_initialized():
        for name in ("pp", "dp", "cp"):
            group = getattr(pg_collection, name, None)
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(stats, group=group)
    if stats[1] == 0:
        return {}
    return {"indexer_loss": float(stats[0] / stats[1])}


def indexer_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the lightning indexers' parameters in ``model``."""
    return [n for n, _ in model.named_parameters() if ".indexer." in n]


def freeze_all_but_indexer(model: torch.nn.Module) -> int:
    """Dense warm-up: ``requires_grad=False`` on every parameter outside the indexers (megatron's DDP and optimizer
    then skip them); returns how many parameters stay trainable."""
    trainable = 0
    for name, p in model.named_parameters():
        keep = ".indexer." in name
        p.requires_grad_(keep)
        trainable += p.numel() if keep else 0
    return trainable


__all__ = ["IndexerLossAutoScaler", "LightningIndexer", "attention_mass",
           "clear_indexer_loss_tracker", "normalise_target",
           "dense_causal_indices", "freeze_all_but_indexer", "indexer_kl", "indexer_loss_report",
           "indexer_parameters", "indexer_scores_at", "record_indexer_loss", "rotate_half_rope"]
