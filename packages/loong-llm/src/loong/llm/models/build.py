"""Turn a :class:`DenseModelConfig` into megatron-core's TransformerConfig, layer spec and GPTModel.

Why GPTModel: megatron-core 0.19 marks GPTModel deprecated in favour of HybridModel, but HybridModel's
stack hard-codes Transformer Engine modules (its final norm is ``TENorm``) and has no llama3 rope
scaling, so it cannot run where TE is absent (CPU, and the H200 image here). GPTModel with our own
layer spec is the path that runs everywhere; the checkpoint keys are the same TE-style keys either way.

``model.fused_kernels`` swaps loong-kernels' fused modules into that spec (:mod:`loong.llm.models.fused`);
the modules keep megatron's parameter names, so checkpoints and the HF mapping do not change.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.utils import get_pg_rank

from loong.core.config.schema import ParallelConfig
from loong.core.errors import LoongError
from loong.llm.models.attention import FusedRoPESelfAttention, core_attention_for
from loong.llm.models.config import DenseModelConfig, runs_sequence_parallel
from loong.llm.models.fused import FusedKernels, FusedRMSNorm, FusedSwiGLU, resolve_fused_kernels
from loong.llm.models.gpt import LoongGPTModel
from loong.llm.models.grouped_experts import uses_grouped_mm, with_grouped_mm_experts
from loong.llm.models.norm import SPRMSNorm


def transformer_config(
    model: DenseModelConfig,
    parallel: ParallelConfig,
    dtype: torch.dtype,
    overrides: dict[str, Any] | None = None,
) -> TransformerConfig:
    """megatron-core's TransformerConfig for ``model`` at ``parallel``, in ``dtype``.

    ``overrides`` come from the accelerator (e.g. CPU initialisation on the CPU).
    """
    kwargs: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        # Parallel sizes must be in the model config too, or every pipeline stage builds every layer.
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        # on for MoE and MLA at TP > 1 whatever parallel.sequence_parallel says (see runs_sequence_parallel)
        sequence_parallel=runs_sequence_parallel(model, parallel.tp, parallel.sequence_parallel),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )
    if model.recompute != "none":
        if model.recompute_num_layers < 1:
            raise LoongError(f"model.recompute_num_layers={model.recompute_num_layers}: must be at least 1")
        if model.recompute == "selective" and model.is_dsa:
            raise LoongError("model.recompute=selective recomputes megatron's core attention, which DeepSeek-V3.2's "
                             "sparse attention does not use (nothing would be recomputed); use model.recompute=full")
        kwargs["recompute_granularity"] = model.recompute
        if model.recompute == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=model.recompute_num_layers)
    if model.is_moe:
        kwargs.update(moe_kwargs(model))
    if model.is_mla:  # DeepSeek-V3 / V3.2 (models/deepseek_v3/spec.py)
        from loong.llm.models.deepseek_v3.spec import deepseek_moe_kwargs, mla_kwargs

        kwargs.update(mla_kwargs(model))
        if model.is_moe:
            kwargs.update(deepseek_moe_kwargs(model))
        if model.is_dsa:  # DeepSeek-V3.2: the schedule scales the indexer loss's gradient like the MoE aux loss
            from loong.llm.models.deepseek_v32.indexer import IndexerLossAutoScaler

            kwargs["experimental_attention_variant_loss_scale_func"] = IndexerLossAutoScaler.set_loss_scale
        kwargs.update(overrides or {})
        return MLATransformerConfig(**kwargs)
    kwargs.update(overrides or {})
    return TransformerConfig(**kwargs)


def moe_kwargs(model: DenseModelConfig) -> dict[str, Any]:
    """megatron-core's MoE settings for ``model``: softmax top-k routing (Qwen3-MoE), the load-balancing
    aux loss, no token dropping, fp32 router, no fused permutation (it needs Transformer Engine).

    Top-k then softmax over the k (``moe_router_pre_softmax=False``) is HF's softmax-then-top-k with the
    k probabilities renormalised (``norm_topk_prob=True``); softmax then top-k (``pre_softmax=True``) is
    ``norm_topk_prob=False``.
    """
    return dict(
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=model.expert_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk,
        moe_router_pre_softmax=not model.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=model.moe_token_dispatcher,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
    )


def layer_spec(model: DenseModelConfig, capabilities: set[str], fused: FusedKernels | None = None,
               sequence_parallel: bool = False) -> ModuleSpec:
    """Transformer Engine's layer spec when installed; otherwise megatron-core's local modules with
    SDPA core attention (the stock local attention materialises the full score matrix), under
    ``sequence_parallel`` :class:`~loong.llm.models.norm.SPRMSNorm` norms, and per ``fused``,
    loong-kernels' RMSNorm, SwiGLU and RoPE in place of megatron's PyTorch ones."""
    if "transformer_engine" in capabilities:
        return get_gpt_layer_with_transformer_engine_spec(num_experts=model.num_experts, moe_grouped_gemm=False,
                                                          qk_layernorm=model.qk_norm)
    # MoE: megatron's MoELayer with SequentialMLP experts (one ColumnParallel/RowParallel MLP per local
    # expert): the expert implementation that needs neither Transformer Engine nor grouped_gemm
    spec = get_gpt_layer_local_spec(num_experts=model.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=model.qk_norm, normalization="RMSNorm")
    layer, attn = spec.submodules, spec.submodules.self_attention
    attn.submodules.core_attention = core_attention_for(capabilities)  # FlexAttention for packed documents
    fused = fused or FusedKernels()
    if sequence_parallel:  # megatron's torch norms refuse SP; the fused norm is off under SP
        layer.input_layernorm = layer.pre_mlp_layernorm = SPRMSNorm
        if model.qk_norm:
            attn.submodules.q_layernorm = attn.submodules.k_layernorm = partial(SPRMSNorm, for_qk=True)
    elif fused.norm:
        norm = partial(FusedRMSNorm, backend=fused.backend)
        layer.input_layernorm = layer.pre_mlp_layernorm = norm
        if model.qk_norm:
            attn.submodules.q_layernorm = attn.submodules.k_layernorm = norm
    if fused.swiglu:  # megatron's MLP calls this module on the whole fc1 output (see build_gpt_model)
        act = partial(FusedSwiGLU, backend=fused.backend)
        if model.is_moe:  # every expert is a megatron MLP: MoELayer -> SequentialMLP -> MLPSubmodules
            moe = layer.mlp
            experts = moe.keywords["submodules"].experts
            experts = _with_submodules(experts, dataclasses.replace(experts.keywords["submodules"],
                                                                    activation_func=act))
            layer.mlp = _with_submodules(moe, dataclasses.replace(moe.keywords["submodules"], experts=experts))
        else:
            layer.mlp = _with_submodules(layer.mlp, dataclasses.replace(layer.mlp.keywords["submodules"],
                                                                        activation_func=act))
    if fused.rope:
        attn.module = FusedRoPESelfAttention
        attn.params = {**attn.params, "rope_backend": fused.backend}
    if uses_grouped_mm(model, capabilities):
        layer.mlp = with_grouped_mm_experts(layer.mlp)
    return spec


def _with_submodules(builder: partial, submodules: Any) -> partial:
    return partial(builder.func, *builder.args, **{**builder.keywords, "submodules": submodules})


def _decoder_spec(spec: ModuleSpec, config: TransformerConfig, fused: FusedKernels, pg_collection: Any,
                  vp_stage: int | None) -> ModuleSpec | TransformerBlockSubmodules:
    """The layer spec, or with fused (or sequence-parallel) norms a block spec whose final norm is the same
    kind (megatron's block otherwise picks its own norm class for it)."""
    sp = spec.submodules.input_layernorm is SPRMSNorm
    if not (fused.norm or sp):
        return spec
    pp_rank = get_pg_rank(getattr(pg_collection, "pp", None))
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    final = SPRMSNorm if sp else partial(FusedRMSNorm, backend=fused.backend)
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=final)


def build_gpt_model(
    model: DenseModelConfig,
    config: TransformerConfig,
    capabilities: set[str],
    pre_process: bool,
    post_process: bool,
    pg_collection: Any,
    vp_stage: int | None = None,
    *,
    fused_kernels: FusedKernels | None = None,
    model_class: Callable[..., LoongGPTModel] | None = None,
) -> GPTModel:
    """One pipeline chunk of the model.

    ``fused_kernels`` overrides the plan that ``model.fused_kernels`` and ``capabilities`` resolve to
    (:func:`~loong.llm.models.fused.resolve_fused_kernels`); tests use it to wire the fused modules with
    the reference backend on CPU. ``model_class`` (None: LoongGPTModel) builds the chunk from the same arguments (a subclass of
    :class:`~loong.llm.models.gpt.LoongGPTModel`, or a ``partial`` of one with its own keywords: loong-vlm's
    foundation).
    """
    fused = fused_kernels
    if fused is None:
        fused = resolve_fused_kernels(model.fused_kernels, capabilities, config)
    # megatron's MLP applies the spec's activation module to the whole fused gate-up output only under
    # this flag (named for Transformer Engine, but it only selects MLPSubmodules.activation_func); set it
    # both ways so a config reused for an unfused build gets megatron's own GLU back
    config.use_te_activation_func = fused.swiglu
    sp = config.sequence_parallel and "transformer_engine" not in capabilities
    mtp_spec = None
    if model.is_mla:
        from loong.llm.models.deepseek_v3.spec import decoder_block_spec, mtp_block_spec

        attention = None
        if model.is_dsa:  # DeepSeek-V3.2: MLA over the lightning indexer's top-k keys
            from loong.llm.models.deepseek_v32.attention import DSAMLASelfAttention, dsa_params

            # the DSA kernels follow model.fused_kernels: auto -> Triton on CUDA, on -> required, off -> the
            # plain-PyTorch references
            backend = {"auto": "auto", "on": "triton", "off": "reference"}[model.fused_kernels]
            attention = (DSAMLASelfAttention, dsa_params(model, backend))
        spec, last = decoder_block_spec(model, config, capabilities, fused, sp, pg_collection, vp_stage,
                                        attention=attention)
        mtp_spec = mtp_block_spec(model, capabilities, fused, sp, last)
    else:
        spec = _decoder_spec(layer_spec(model, capabilities, fused, sequence_parallel=sp), config, fused,
                             pg_collection, vp_stage)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="GPTModel IS DEPRECATED")
        gpt = (model_class or LoongGPTModel)(  # LoongGPTModel: GPTModel whose RoPE follows position_ids (packed SFT)
            config=config,
            transformer_layer_spec=spec,
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(model.rope_theta),
            pg_collection=pg_collection,
            vp_stage=vp_stage,
            mtp_block_spec=mtp_spec,
            fused_kernels=fused,
        )
    if model.rope_scaling is not None and not model.is_mla:  # MLA: megatron's own (YaRN) rotary embedding
        rope = gpt.rotary_pos_emb
        kv = model.kv_channels
        base = 1.0 / (model.rope_theta ** (torch.arange(0, kv, 2, dtype=torch.float32) / kv))
        rs = model.rope_scaling
        rope.inv_freq = rope._apply_scaling(
            base.to(rope.inv_freq.device),
            factor=rs.factor,
            low_freq_factor=rs.low_freq_factor,
            high_freq_factor=rs.high_freq_factor,
            original_max_position_embeddings=rs.original_max_position_embeddings,
        )
    return gpt
