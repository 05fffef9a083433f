"""Attention modules for megatron-core layer specs when Transformer Engine is absent.

- :class:`SDPAttention`: megatron-core's local ``DotProductAttention`` materialises the full
  [b, heads, s, s] score matrix; this computes the same causal attention through
  ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU, a fused
  kernel on CPU) with the same constructor and forward signature, so it drops into
  ``SelfAttentionSubmodules.core_attention``. Under context parallelism it runs
  :func:`loong.core.engines.megatron.context_parallel.causal_attention_cp` (all-gathered keys and values).
  Packed sequences arrive as per-token document ids instead of a mask (packed SFT) and run through
  :func:`loong.core.attention.varlen_attention`; :class:`FlexSDPAttention` takes its FlexAttention kernel
  (:func:`core_attention_for` picks the class from the accelerator's capabilities).
- :class:`FusedRoPESelfAttention`: megatron-core's ``SelfAttention`` with the rotary embedding applied to
  q and k by loong-kernels' ``apply_rope`` (one kernel for each, reading q/k straight from the split QKV
  projection) instead of megatron's unfused ``t * cos + rotate_half(t) * sin``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from loong.core.accelerators.capabilities import FLEX_ATTENTION
from loong.core.attention import FLEX, REFERENCE, varlen_attention


def is_document_ids(attention_mask: torch.Tensor | None) -> bool:
    """Whether megatron's ``attention_mask`` argument carries per-token document ids ``[b, s]`` (an integer
    tensor; negative = padding) rather than a boolean mask ``[b, 1, s, s]`` (True = masked out)."""
    return (attention_mask is not None and attention_mask.dim() == 2 and attention_mask.dtype != torch.bool
            and not attention_mask.dtype.is_floating_point)


class SDPAttention(MegatronModule):
    """Causal (grouped-query) attention over [s, b, heads, d] inputs, returning [s, b, heads*d_v].

    ``k_channels``/``v_channels`` (multi-latent attention) may differ: the output has the value width.
    An ``attention_mask`` of document ids ``[b, s]`` (:func:`is_document_ids`) keeps every packed document to
    itself (varlen attention, no ``[s, s]`` mask; padding tokens get 0); a boolean mask is applied as SDPA's.
    """

    #: the varlen implementation for document ids (loong.core.attention.varlen); FlexSDPAttention's is FlexAttention
    varlen_impl = REFERENCE

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        super().__init__(config=config)
        self.cp_group = getattr(pg_collection, "cp", None) if config.context_parallel_size > 1 else None
        if config.context_parallel_size > 1 and self.cp_group is None:
            raise ValueError("SDPAttention with context parallelism needs megatron's pg_collection (its cp group)")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # multi-latent attention passes its own q/k width (nope + rope) and a narrower value width;
        # SDPA takes value heads of any width, so only the default scale needs the key width
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(k_channels or config.kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("SDPAttention does not support packed sequences")
        mask_type = attn_mask_type or self.attn_mask_type
        if self.cp_group is not None:
            docs = is_document_ids(attention_mask)
            if (attention_mask is not None and not docs) or mask_type != AttnMaskType.causal:
                raise ValueError("context parallelism supports causal attention, optionally of packed documents "
                                 "(document ids), without another mask")
            if docs and self.training and self.dropout_p > 0:
                raise ValueError("packed documents (document ids) run without attention dropout; set it to 0")
            from loong.core.engines.megatron.context_parallel import causal_attention_cp

            out = causal_attention_cp(query, key, value, self.cp_group, scale=self.softmax_scale,
                                      dropout_p=self.dropout_p if self.training else 0.0,
                                      document_ids=attention_mask if docs else None)
            return out.reshape(out.shape[0], out.shape[1], -1)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        s, b = query.shape[0], query.shape[1]
        if is_document_ids(attention_mask):
            if self.training and self.dropout_p > 0:
                raise ValueError("packed documents (document ids) run without attention dropout; set it to 0")
            out = varlen_attention(q, k, v, attention_mask, causal=mask_type == AttnMaskType.causal,
                                   scale=self.softmax_scale, impl=self.varlen_impl)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # megatron: True = masked out; SDPA: True = attend
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class FlexSDPAttention(SDPAttention):
    """:class:`SDPAttention` whose packed documents run through compiled FlexAttention (a block-sparse document
    mask) instead of one SDPA call per document."""

    varlen_impl = FLEX


def core_attention_for(capabilities: set[str]) -> type[SDPAttention]:
    """The core-attention class for a layer spec: :class:`FlexSDPAttention` where the accelerator reports
    ``flex_attention``, else :class:`SDPAttention`. A class, not a partial: megatron's multi-latent attention
    builds its core attention through ``build_module``, which takes classes and specs only."""
    return FlexSDPAttention if FLEX_ATTENTION in capabilities else SDPAttention


def rope_tables(emb: torch.Tensor, interleaved: bool, mscale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-width ``cos, sin`` ``[s, b|1, r]`` (fp32) from megatron's rotary tensor ``emb [s, b|1, 1, 2r]``.

    ``emb`` is ``cat(freqs, freqs)`` (``stack(...).flatten`` when interleaved), so the first half (every other
    channel) holds each frequency once; megatron multiplies cos and sin by YaRN's ``mscale``.
    """
    freqs = emb.squeeze(2)
    freqs = freqs[..., 0::2] if interleaved else freqs[..., : freqs.shape[-1] // 2]
    cos, sin = freqs.cos(), freqs.sin()
    if mscale is not None and mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    return cos, sin


class FusedRoPESelfAttention(SelfAttention):
    """``SelfAttention`` whose q/k rotation runs through ``loong.kernels.apply_rope``.

    The rotary tensor arrives exactly as megatron passes it (so activation recompute and pipeline stages
    see nothing new); for the length of one forward it is held here and applied right after the QKV
    projection (and QK-norm), where megatron would apply its own. Inference contexts, packed (THD)
    sequences, cross attention and already-split ``(q_emb, k_emb)`` pairs take megatron's path.
    """

    def __init__(self, *args: Any, rope_backend: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rope_backend = rope_backend
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        emb = kwargs.get("rotary_pos_emb")
        megatron_path = (
            args  # positional extras: not how TransformerLayer calls attention
            or not isinstance(emb, torch.Tensor)
            or kwargs.get("key_value_states") is not None
            or kwargs.get("inference_context") is not None
            or kwargs.get("inference_params") is not None
            or kwargs.get("packed_seq_params") is not None
            or kwargs.get("rotary_pos_cos") is not None
        )
        if megatron_path:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        self._rope = rope_tables(emb, self.config.rotary_interleaved, self._yarn_concentration_factor)
        try:
            return super().forward(hidden_states, attention_mask, **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._rope = None

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,
                                    output_gate: bool = False, split_qkv: bool = True) -> Any:
        out = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                  split_qkv=split_qkv)
        if self._rope is None:
            return out
        from loong.kernels import apply_rope

        cos, sin = self._rope
        query, key = apply_rope(out[0], out[1], cos, sin, layout="sbhd", interleaved=self.config.rotary_interleaved,
                                backend=self.rope_backend)
        return (query, key, *out[2:])
