"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention (QK-norm, explicit ``head_dim``) with a sparse MLP in
every layer — softmax top-k routing over ``num_experts`` SwiGLU experts, no shared expert, optional
renormalisation of the top-k probabilities (``norm_topk_prob``), Switch-style load-balancing aux loss.

Only all-sparse models are read (``decoder_sparse_step=1``, no ``mlp_only_layers``): every released
Qwen3-MoE checkpoint is one. Checkpoint files store the experts one tensor each
(``mlp.experts.{e}.{gate,up,down}_proj.weight``); transformers 5 fuses them into 3-D parameters only in
memory (``mlp.experts.gate_up_proj``) and writes them back per expert, so the mapping is to the files' names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig
from loong.llm.models.hf_config import HFFamily


@dataclass(frozen=True)
class MoEHFFamily(HFFamily):
    """A dense family's config.json translation plus the Qwen3-MoE expert fields."""

    def config_from_hf(self, hf: dict[str, Any]) -> DenseModelConfig:
        where = f"{self.architectures[0]} config"
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        if step != 1 or hf.get("mlp_only_layers"):
            raise LoongError(f"{where}: decoder_sparse_step={step}, mlp_only_layers={hf.get('mlp_only_layers')}: "
                             "models with dense layers between the sparse ones are not supported")
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if not experts:
            raise LoongError(f"{where}: num_experts is missing or 0 (a dense model?)")
        cfg = super().config_from_hf(hf)
        cfg.num_experts = int(experts)
        cfg.moe_ffn_hidden_size = int(hf["moe_intermediate_size"])
        cfg.moe_router_topk = int(hf.get("num_experts_per_tok", 8))
        cfg.norm_topk_prob = bool(hf.get("norm_topk_prob", False))
        cfg.moe_aux_loss_coeff = float(hf.get("router_aux_loss_coef", 0.001))
        return cfg

    def hf_config_dict(self, cfg: DenseModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
        if not cfg.is_moe:
            raise LoongError("model.family=qwen3_moe needs model.num_experts")
        out = super().hf_config_dict(cfg, dtype)
        out.update(
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.expert_ffn_hidden_size,
            num_experts_per_tok=cfg.moe_router_topk,
            norm_topk_prob=cfg.norm_topk_prob,
            router_aux_loss_coef=cfg.moe_aux_loss_coeff,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
        )
        return out


FAMILY = MoEHFFamily(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_type="qwen3_moe",
    qkv_bias=False,
    qk_norm=True,
    head_dim_default=128,
    max_position_default=32768,
    sliding_window_field=True,
)

config_from_hf = FAMILY.config_from_hf
hf_config_dict = FAMILY.hf_config_dict

__all__ = ["FAMILY", "MoEHFFamily", "config_from_hf", "hf_config_dict"]
