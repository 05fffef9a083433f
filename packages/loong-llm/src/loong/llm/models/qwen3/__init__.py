"""Qwen3 dense (``Qwen3ForCausalLM``): per-head RMSNorm on queries and keys, explicit ``head_dim``."""

from __future__ import annotations

from loong.llm.models.hf_config import HFFamily

FAMILY = HFFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_type="qwen3",
    qkv_bias=False,
    qk_norm=True,
    head_dim_default=128,
    max_position_default=32768,
    sliding_window_field=True,
)

config_from_hf = FAMILY.config_from_hf
hf_config_dict = FAMILY.hf_config_dict

__all__ = ["FAMILY", "config_from_hf", "hf_config_dict"]
