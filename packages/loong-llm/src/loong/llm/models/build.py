"""Turn a :class:`DenseModelConfig` into megatron-core's TransformerConfig, layer spec and GPTModel.

Why GPTModel: megatron-core 0.19 marks GPTModel deprecated in favour of HybridModel, but HybridModel's
stack hard-codes Transformer Engine modules (its final norm is ``TENorm``) and has no llama3 rope
scaling, so it cannot run where TE is absent (CPU, and the H200 image here). GPTModel with our own
layer spec is the path that runs everywhere; the checkpoint keys are the same TE-style keys either way.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from loong.core.config.schema import ParallelConfig
from loong.llm.models.attention import SDPAttention
from loong.llm.models.config import DenseModelConfig
from loong.llm.models.gpt import LoongGPTModel


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
        sequence_parallel=parallel.sequence_parallel and parallel.tp > 1,
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
    kwargs.update(overrides or {})
    return TransformerConfig(**kwargs)


def layer_spec(model: DenseModelConfig, capabilities: set[str]) -> ModuleSpec:
    """Transformer Engine's layer spec when installed; otherwise megatron-core's local modules with
    SDPA core attention (the stock local attention materialises the full score matrix)."""
    if "transformer_engine" in capabilities:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_norm)
    spec = get_gpt_layer_local_spec(qk_layernorm=model.qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_gpt_model(
    model: DenseModelConfig,
    config: TransformerConfig,
    capabilities: set[str],
    pre_process: bool,
    post_process: bool,
    pg_collection: Any,
    vp_stage: int | None = None,
) -> GPTModel:
    """One pipeline chunk of the model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="GPTModel IS DEPRECATED")
        gpt = LoongGPTModel(  # GPTModel whose RoPE follows position_ids (packed SFT)
            config=config,
            transformer_layer_spec=layer_spec(model, capabilities),
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
        )
    if model.rope_scaling is not None:
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
