"""DeepSeek Sparse Attention as a megatron MLA module: :class:`DSAMLASelfAttention`.

It is :class:`~loong.llm.models.deepseek_v3.spec.LoongMLASelfAttention` (same parameters, same TP/SP plumbing of
the down-projections and latent norms) with its own forward:

1. MLA's projections as megatron computes them, but the keys and values are *not* expanded per head: the query is
   absorbed instead (MQA form, as DeepSeek runs V3.2): ``q_lat[h] = q_nope[h] · W_UK[h]`` (``kv_lora_rank``
   channels) next to the roped ``q_pe``, against one shared row ``[c_kv, k_pe]`` per token; the attention's output
   ``o_lat[h]`` (latent width) becomes ``o_lat[h] · W_UV[h]ᵀ`` before ``linear_proj``. ``q·k`` and the value are
   exactly MHA-form MLA's (``q_nope·(W_UK c) = (q_nope W_UK)·c``), so HF's numerics are kept; fp32 agrees to 1e-5.
2. The lightning indexer (:class:`~.indexer.LightningIndexer`, on the detached layer input and q latent) picks
   ``index_topk`` keys per query (``loong.kernels.dsa.indexer_topk``), or, in the dense warm-up, every causal key.
3. ``loong.kernels.dsa.sparse_mla_attention`` attends over those keys (Triton on CUDA, the reference on CPU) and
   returns the log-sum-exp the indexer loss needs.
4. In training, the indexer loss ``KL(p_t || softmax(I_t))`` over the same keys (:mod:`.indexer`) joins the
   gradient through :class:`~.indexer.IndexerLossAutoScaler` times ``indexer_loss_coeff``.

Tensor parallelism (sequence parallelism is on for MLA at TP > 1): each rank has ``H / TP`` heads and the whole
sequence of queries; the latent ``c_kv`` is gathered over the sequence (backward: reduce-scatter, so every rank's
heads' gradient is summed); the indexer is replicated and computed on the whole (gathered) sequence on every rank,
and its target sums the heads over TP (an all-reduce), so every rank computes the same loss and gradients.
Context parallelism (``parallel.cp``, megatron's zigzag split: each rank holds two chunks of every sequence): the
latent rows ``[c_kv, k_pe]`` and the indexer's keys are all-gathered over the CP group into the whole sequence
(backward: reduce-scatter, so every key's gradient reaches its owner), each local chunk's queries select among the
keys up to the chunk's end (the indexer top-k with bottom-right causal alignment), and the sparse kernels attend over
the gathered rows. The indexer loss is each rank's queries' mean, divided by the CP size for the gradient (megatron's
schedule scales it by CP and its DDP averages over DP x CP), so the gradient is the whole sequences' mean's.
Not supported (a clear error): packed sequences, an explicit attention mask, inference caches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings import apply_rotary_pos_emb
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.utils import get_pg_size
from torch.utils.checkpoint import checkpoint

from loong.core.engines.megatron.context_parallel import cp_chunks, gather_sequence
from loong.core.errors import LoongError
from loong.llm.models.deepseek_v3.spec import LoongMLASelfAttention
from loong.llm.models.deepseek_v32.indexer import (
    IndexerLossAutoScaler,
    LightningIndexer,
    attention_mass,
    dense_causal_indices,
    indexer_kl,
    normalise_target,
    record_indexer_loss,
)


class DSAMLASelfAttention(LoongMLASelfAttention):
    """MLA in absorbed (MQA) form over the lightning indexer's top-k keys, with the indexer's training loss.

    ``index_n_heads``, ``index_head_dim``, ``index_topk``, ``dsa_stage`` and ``indexer_loss_coeff`` come from the
    ``dsa`` dict :func:`~loong.llm.models.deepseek_v3.spec.mla_layer_spec` passes through the layer spec's params.
    """

    def __init__(self, config: Any, *args: Any, dsa: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if config.q_lora_rank is None:
            raise LoongError("DeepSeek-V3.2's indexer reads the q latent: q_lora_rank must be set")
        self.index_topk = int(dsa["index_topk"])
        self.dsa_stage = dsa["dsa_stage"]
        self.indexer_loss_coeff = float(dsa["indexer_loss_coeff"])
        self.kernel_backend = dsa.get("backend", "auto")
        self.head_chunks = int(dsa.get("head_chunks", 1))
        if self.num_attention_heads_per_partition % self.head_chunks:
            raise LoongError(f"model.dsa_head_chunks={self.head_chunks} must divide the "
                             f"{self.num_attention_heads_per_partition} attention heads of each tensor-parallel rank")
        self.indexer = LightningIndexer(config, config.q_lora_rank, int(dsa["index_n_heads"]),
                                        int(dsa["index_head_dim"]), config.qk_pos_emb_head_dim)

    def _cp(self) -> Any:
        """The context-parallel group, or None without context parallelism."""
        return self.pg_collection.cp if self.config.context_parallel_size > 1 else None

    def _sp(self) -> bool:
        return bool(self.config.sequence_parallel) and get_pg_size(self.tp_group) > 1

    def _rope(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, float]:
        seq = self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, self.config, None)
        if self.config.rope_type == "rope":
            return self.rotary_pos_emb(seq), 1.0
        emb, mscale = self.rotary_pos_emb(seq)
        return emb, mscale

    def _latents(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Megatron's down-projections, split and norms: ``(q latent [s/tp, b, r] normed, c_kv [s/tp, b, c] normed,
        k_pe [s, b, rope] before RoPE)``, exactly as ``MLASelfAttention.get_query_key_value_tensors``."""
        cfg = self.config
        q_compressed, kv_combined = self._qkv_down_projection(hidden_states)
        if kv_combined.size(-1) != cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim:  # a TP-split down-projection
            from megatron.core.tensor_parallel.mappings import (
                gather_from_tensor_model_parallel_region,
                scatter_to_sequence_parallel_region,
            )

            kv_combined = gather_from_tensor_model_parallel_region(kv_combined)
            kv_compressed, k_pe = torch.split(kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
            if cfg.sequence_parallel:
                kv_compressed = scatter_to_sequence_parallel_region(kv_compressed)
        else:
            kv_compressed, k_pe = torch.split(kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
            if self._sp():
                k_pe = gather_from_sequence_parallel_region(k_pe, group=self.tp_group)
        return self.q_layernorm(q_compressed), self.kv_layernorm(kv_compressed), k_pe

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, key_value_states: Any = None,
                inference_context: Any = None, rotary_pos_emb: Any = None, rotary_pos_cos: Any = None,
                rotary_pos_sin: Any = None, rotary_pos_cos_sin: Any = None, attention_bias: Any = None,
                packed_seq_params: Any = None, position_ids: Any = None, sequence_len_offset: Any = None, *,
                inference_params: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden_states [s(/tp), b, d]`` -> ``(output [s(/tp), b, d], bias)`` as megatron's MLA."""
        if inference_context is not None or inference_params is not None or key_value_states is not None:
            raise LoongError("DeepSeek sparse attention: inference caches and cross attention are not supported")
        if packed_seq_params is not None or attention_mask is not None:
            raise LoongError("DeepSeek sparse attention supports causal attention over whole sequences only (no "
                             "packed sequences or explicit attention masks)")
        cfg = self.config
        heads, nope, rope_dim = self.num_attention_heads_per_partition, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim
        emb, mscale = self._rope(hidden_states)
        q_latent, c_kv, k_pe = self._latents(hidden_states)

        q, _ = self.linear_q_up_proj(q_latent)  # [s, b, heads * (nope + rope)] (gathered over the sequence)
        s, b = q.shape[:2]
        emb = emb[:s]
        q_nope, q_pe = torch.split(q.view(s, b, heads, nope + rope_dim), [nope, rope_dim], dim=-1)
        rope_kw = dict(config=cfg, cu_seqlens=None, mscale=mscale, cp_group=self.pg_collection.cp,
                       mla_rotary_interleaved=True)
        q_pe = apply_rotary_pos_emb(q_pe, emb, **rope_kw)
        k_pe = apply_rotary_pos_emb(k_pe.unsqueeze(-2), emb, **rope_kw).squeeze(-2)  # [s, b, rope]
        if self._sp():
            c_kv = gather_from_sequence_parallel_region(c_kv, group=self.tp_group)  # [s, b, c]

        # absorb W_UK into the query; W_UV is applied to the latent output (in _core)
        w_up = self.linear_kv_up_proj.weight.view(heads, nope + cfg.v_head_dim, cfg.kv_lora_rank)
        w_uk, w_uv = torch.split(w_up, [nope, cfg.v_head_dim], dim=1)
        kv = torch.cat([c_kv, k_pe], dim=-1)  # [s, b, c + rope]
        idx_q, idx_k, idx_w = self._indexer_inputs(hidden_states, q_latent, emb, mscale)
        cp = self._cp()
        if cp is not None:  # every key of the sequence, from the CP group
            kv = gather_sequence(kv, cp)
            idx_k = gather_sequence(idx_k.transpose(0, 1), cp).transpose(0, 1)
        kv = kv.transpose(0, 1).contiguous()  # [b, S, c + rope]
        indices = self._select(idx_q, idx_k, idx_w, b)
        train_indexer = self.training and torch.is_grad_enabled()
        outs, mass = [], None
        group = heads // self.head_chunks
        for h0 in range(0, heads, group):
            args = (q_nope[:, :, h0:h0 + group], q_pe[:, :, h0:h0 + group], kv, indices, w_uk[h0:h0 + group],
                    w_uv[h0:h0 + group])
            if self.head_chunks > 1 and torch.is_grad_enabled():
                # keep only the inputs: the head group's query and latent output are recomputed in the backward
                out_h, lse_h, query_h = checkpoint(self._core, *args, use_reentrant=False)
            else:
                out_h, lse_h, query_h = self._core(*args)
            outs.append(out_h)
            if train_indexer:
                part = attention_mass(query_h.detach(), kv.detach(), indices, lse_h, self.softmax_scale)
                mass = part if mass is None else mass + part
            del query_h
        out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).reshape(s, b, heads * cfg.v_head_dim)
        output, bias = self.linear_proj(out)

        if train_indexer:
            target = normalise_target(mass, tp_group=self.tp_group)
            loss = indexer_kl(idx_q, idx_k, idx_w, indices, target)
            record_indexer_loss(loss)
            cp_size = 1 if cp is None else cp.size()
            output = IndexerLossAutoScaler.apply(output, loss * (self.indexer_loss_coeff / cp_size))
        return output, bias

    def _core(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
              w_uk: torch.Tensor, w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Absorbed attention of a group of heads: ``q_nope [s, b, h, nope]`` and roped ``q_pe [s, b, h, rope]``
        against the shared ``kv [b, s, c + rope]`` at ``indices`` -> ``(out [s, b, h, v], lse [b, s, h], query [b, s,
        h, c + rope])``."""
        from loong.kernels.dsa import sparse_mla_attention

        q_lat = torch.einsum("sbhn,hnc->bshc", q_nope, w_uk)
        query = torch.cat([q_lat, q_pe.transpose(0, 1)], dim=-1).contiguous()  # [b, s, h, c + rope]
        out_lat, lse = sparse_mla_attention(query, kv, indices, softmax_scale=self.softmax_scale,
                                            v_dim=self.config.kv_lora_rank, backend=self.kernel_backend)
        return torch.einsum("bshc,hvc->sbhv", out_lat, w_uv), lse, query

    def _indexer_inputs(self, hidden_states: torch.Tensor, q_latent: torch.Tensor, emb: torch.Tensor,
                        mscale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's q, k, w on the whole sequence, from inputs detached from the main model's graph (the paper:
        the indexer learns only from its own loss; in the dense warm-up the main model is frozen anyway)."""
        x, ql = hidden_states.detach(), q_latent.detach()
        if self._sp():
            x = gather_from_sequence_parallel_region(x, group=self.tp_group)
            ql = gather_from_sequence_parallel_region(ql, group=self.tp_group)
        # megatron's rotary table is cat(freqs, freqs) [s, 1, 1, rope]: the half-split layout transformers' indexer
        # uses, and YaRN's mscale multiplies cos and sin as in MLA
        cos, sin = (emb.cos() * mscale).to(x.dtype), (emb.sin() * mscale).to(x.dtype)
        return self.indexer(x, ql, cos, sin)

    def _select(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, b: int) -> torch.Tensor:
        """``[b, s, K]`` int32 positions in ``k [b, S, D]`` (the whole sequence) for this rank's queries ``q [b, s, H,
        D]``: all of them, or under context parallelism each of its two chunks against the keys up to the chunk's end
        (the chunks' rows padded with -1 to one width)."""
        cp = self._cp()
        if cp is None:
            return self._select_rows(q, k, w, b)
        half = q.shape[1] // 2
        parts = []
        for part, chunk in enumerate(cp_chunks(cp.size(), cp.rank())):
            rows = slice(part * half, (part + 1) * half)
            parts.append(self._select_rows(q[:, rows], k[:, :(chunk + 1) * half], w[:, rows], b))
        width = max(p.shape[-1] for p in parts)
        return torch.cat([F.pad(p, (0, width - p.shape[-1]), value=-1) for p in parts], dim=1)

    def _select_rows(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, b: int) -> torch.Tensor:
        """Queries ``q`` at the last positions of ``k``: every causal key in the dense warm-up or when ``index_topk``
        reaches the key count (the same set transformers' top-k selects then), else the indexer's top-k."""
        if self.dsa_stage == "dense_warmup" or self.index_topk >= k.shape[1]:
            return dense_causal_indices(b, q.shape[1], q.device, n_keys=k.shape[1])
        from loong.kernels.dsa import indexer_topk

        return indexer_topk(q, k, w, self.index_topk, causal=True, backend=self.kernel_backend)


def dsa_params(model: Any, backend: str = "auto") -> dict[str, Any]:
    """The layer spec's extra constructor arguments for :class:`DSAMLASelfAttention` from a ``DenseModelConfig``."""
    return {"dsa": {"index_n_heads": model.index_n_heads, "index_head_dim": model.index_head_dim,
                    "index_topk": model.index_topk, "dsa_stage": model.dsa_stage,
                    "indexer_loss_coeff": model.indexer_loss_coeff, "backend": backend,
                    "head_chunks": model.dsa_head_chunks}}
