"""megatron-core settings and layer specs for DeepSeek-V3: multi-latent attention, DeepSeekMoE with shared
experts and sigmoid group-limited routing, dense first layers, multi-token prediction.

Everything is megatron-core's own module (``MLASelfAttention``, ``MoELayer`` with ``SequentialMLP`` experts and
shared experts, ``TopKRouter``, ``MultiTokenPredictionBlock``); Loong swaps in only the core attention (SDPA,
which takes MLA's 192-channel keys and 128-channel values), the norms under sequence parallelism
(:class:`~loong.llm.models.norm.SPRMSNorm`) and, per ``model.fused_kernels``, loong-kernels' RMSNorm and SwiGLU.
With Transformer Engine installed, its MLA spec.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from loong.llm.models.attention import SDPAttention
from loong.llm.models.config import DenseModelConfig
from loong.llm.models.fused import FusedKernels, FusedRMSNorm, FusedSwiGLU
from loong.llm.models.grouped_experts import uses_grouped_mm, with_grouped_mm_experts
from loong.llm.models.norm import SPRMSNorm


class SequenceShardLinear(torch.nn.Module):
    """A whole (TP-replicated) linear layer applied to this rank's sequence shard, weight marked
    ``sequence_parallel`` so ``finalize_model_grads`` sums its gradient over TP."""

    def __init__(self, in_features: int, out_features: int, config: TransformerConfig) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=config.params_dtype))
        config.init_method(self.weight)
        self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None


class LoongMLASelfAttention(MLASelfAttention):
    """megatron's ``MLASelfAttention`` whose KV down-projection is whole on every TP rank under sequence
    parallelism.

    Why: without Transformer Engine megatron's spec makes ``linear_kv_down_proj`` a ``ColumnParallelLinear``
    whose output it gathers over TP; the decoupled rope key it then splits off feeds only this rank's heads, and
    the gather's backward (a split) keeps only this rank's share of that key's gradient — measured 7 % off the
    single-rank gradient at TP=2. TE's spec avoids it with a duplicated linear on the sequence shard, whose rope
    key megatron gathers over the sequence (backward: reduce-scatter, the full sum); this is that linear."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if config.sequence_parallel and config.tensor_model_parallel_size > 1:
            self.linear_kv_down_proj = SequenceShardLinear(
                config.hidden_size, config.kv_lora_rank + config.qk_pos_emb_head_dim, config)


def mla_kwargs(model: DenseModelConfig) -> dict[str, Any]:
    """``MLATransformerConfig`` fields: latent ranks, head widths and the (YaRN) rotary embedding."""
    rs = model.rope_yarn
    out: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_nope_head_dim,
        qk_pos_emb_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        rotary_base=model.rope_theta,
        # q_a_layernorm / kv_a_layernorm: megatron builds MLA's latent norms only under qk_layernorm
        qk_layernorm=True,
        # HF's DeepSeek-V3 rotates interleaved (x0, x1) pairs; megatron's MLA path de-interleaves the same way
        # (``mla_rotary_interleaved``), so the global flag stays off
        rotary_interleaved=False,
    )
    if rs is not None:
        out.update(rope_type="yarn", rotary_scaling_factor=rs.factor,
                   original_max_position_embeddings=rs.original_max_position_embeddings,
                   beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, mscale=rs.mscale, mscale_all_dim=rs.mscale_all_dim)
    else:
        out.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return out


def deepseek_moe_kwargs(model: DenseModelConfig) -> dict[str, Any]:
    """DeepSeekMoE on top of :func:`~loong.llm.models.build.moe_kwargs`: dense first layers, shared experts,
    sigmoid scores with the aux-loss-free expert bias, group-limited top-k, the routed scaling factor, and the
    sequence-wise balance loss (DeepSeek-V3's tiny complementary one) when ``moe_aux_loss_coeff`` > 0."""
    n_dense = model.num_dense_layers
    out: dict[str, Any] = dict(
        moe_layer_freq=[0] * n_dense + [1] * (model.num_layers - n_dense),
        moe_shared_expert_intermediate_size=(model.moe_shared_experts * model.expert_ffn_hidden_size) or None,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=model.moe_router_bias_update_rate,
        moe_router_num_groups=model.moe_router_num_groups,
        moe_router_group_topk=model.moe_router_group_topk,
        moe_router_topk_scaling_factor=model.moe_routed_scaling_factor,
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type="seq_aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
    )
    if model.mtp_num_layers:
        out.update(mtp_num_layers=model.mtp_num_layers, mtp_loss_scaling_factor=model.mtp_loss_scaling_factor)
    return out


def _with_submodules(builder: partial, submodules: Any) -> partial:
    return partial(builder.func, *builder.args, **{**builder.keywords, "submodules": submodules})


def _swiglu_mlp(mlp: Any, act: Any) -> Any:
    """``mlp`` (a dense MLP or a MoELayer builder) with ``act`` as every expert's / shared expert's activation."""
    subs = mlp.keywords["submodules"]
    if hasattr(subs, "experts"):  # MoELayer -> SequentialMLP experts and the shared-experts MLP
        experts = _with_submodules(subs.experts, dataclasses.replace(subs.experts.keywords["submodules"],
                                                                     activation_func=act))
        shared = subs.shared_experts
        if shared is not None:
            shared = _with_submodules(shared, dataclasses.replace(shared.keywords["submodules"], activation_func=act))
        return _with_submodules(mlp, dataclasses.replace(subs, experts=experts, shared_experts=shared))
    return _with_submodules(mlp, dataclasses.replace(subs, activation_func=act))


def mla_layer_spec(model: DenseModelConfig, capabilities: set[str], fused: FusedKernels, moe: bool,
                   sequence_parallel: bool = False, core_attention: Any = None,
                   attention: tuple[Any, dict[str, Any]] | None = None) -> ModuleSpec:
    """One decoder layer: MLA self-attention, and a MoE (``moe``) or dense SwiGLU MLP.

    ``core_attention`` replaces the attention kernel; default SDPA. ``attention`` = ``(module, params)`` replaces the
    whole MLA module (a :class:`LoongMLASelfAttention` subclass, built with ``params`` as extra keyword arguments:
    DeepSeek-V3.2's sparse attention, :mod:`loong.llm.models.deepseek_v32.attention`).
    """
    experts = model.num_experts if moe else None
    if "transformer_engine" in capabilities and core_attention is None and attention is None:
        return get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False,
                                                          qk_layernorm=True, multi_latent_attention=True)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    multi_latent_attention=True, normalization="RMSNorm")
    layer, attn = spec.submodules, spec.submodules.self_attention
    attn.module = LoongMLASelfAttention
    if attention is not None:
        attn.module = attention[0]
        attn.params = {**attn.params, **attention[1]}
    attn.submodules.core_attention = core_attention or SDPAttention
    if sequence_parallel:  # megatron's torch norms refuse SP; the fused norm is off under SP
        # MLA scatters both latents back to sequence shards before their norms, so (unlike QK-norm) their
        # weights need the TP gradient sum too: megatron sums ``q_layernorm`` by name but not ``kv_layernorm``
        layer.input_layernorm = layer.pre_mlp_layernorm = SPRMSNorm
        attn.submodules.q_layernorm = attn.submodules.kv_layernorm = SPRMSNorm
    elif fused.norm:
        norm = partial(FusedRMSNorm, backend=fused.backend)
        layer.input_layernorm = layer.pre_mlp_layernorm = norm
        attn.submodules.q_layernorm = attn.submodules.kv_layernorm = norm
    if fused.swiglu:
        layer.mlp = _swiglu_mlp(layer.mlp, partial(FusedSwiGLU, backend=fused.backend))
    if moe and uses_grouped_mm(model, capabilities):
        layer.mlp = with_grouped_mm_experts(layer.mlp)
    return spec


def decoder_block_spec(model: DenseModelConfig, config: TransformerConfig, capabilities: set[str],
                       fused: FusedKernels, sequence_parallel: bool, pg_collection: Any, vp_stage: int | None,
                       core_attention: Any = None, attention: tuple[Any, dict[str, Any]] | None = None,
                       ) -> tuple[TransformerBlockSubmodules, ModuleSpec]:
    """(this pipeline stage's block spec, the MoE layer spec the MTP modules reuse).

    The first ``first_k_dense_replace`` layers are dense, the rest MoE (megatron's ``moe_layer_freq`` list, which
    also makes the checkpoint keys per layer: ``decoder.layers.{i}.…``)."""
    def spec(moe: bool) -> ModuleSpec:
        return mla_layer_spec(model, capabilities, fused, moe, sequence_parallel, core_attention, attention)

    dense, sparse = spec(False), spec(True)
    pattern = [dense] * model.num_dense_layers + [sparse] * (model.num_layers - model.num_dense_layers)
    pp_rank = get_pg_rank(getattr(pg_collection, "pp", None))
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    final = _final_norm(model, capabilities, fused, sequence_parallel)
    return TransformerBlockSubmodules(layer_specs=pattern[offset: offset + n], layer_norm=final), sparse


def _final_norm(model: DenseModelConfig, capabilities: set[str], fused: FusedKernels, sequence_parallel: bool) -> Any:
    if "transformer_engine" in capabilities:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    if sequence_parallel:
        return SPRMSNorm
    if fused.norm:
        return partial(FusedRMSNorm, backend=fused.backend)
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def mtp_block_spec(model: DenseModelConfig, capabilities: set[str], fused: FusedKernels, sequence_parallel: bool,
                   layer: ModuleSpec) -> MultiTokenPredictionBlockSubmodules | None:
    """``mtp_num_layers`` MTP modules: ``enorm``/``hnorm``, the ``[2d -> d]`` ``eh_proj``, one decoder ``layer``
    (MoE, as DeepSeek-V3's) and a final norm; embedding and output layer are the main model's."""
    if not model.mtp_num_layers:
        return None
    norm = _final_norm(model, capabilities, fused, sequence_parallel)
    one = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, layer_norm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=layer))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[one] * model.mtp_num_layers)
