"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): biased q/k/v projections, no QK norm, no sliding window."""

from __future__ import annotations

from loong.llm.models.hf_config import HFFamily

FAMILY = HFFamily(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_type="qwen2",
    qkv_bias=True,
    qk_norm=False,
    max_position_default=32768,
    sliding_window_field=True,
)

config_from_hf = FAMILY.config_from_hf
hf_config_dict = FAMILY.hf_config_dict

__all__ = ["FAMILY", "config_from_hf", "hf_config_dict"]
