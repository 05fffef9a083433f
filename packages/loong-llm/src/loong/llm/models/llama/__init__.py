"""LLaMA 2 / 3 / 3.1 (``LlamaForCausalLM``): no attention bias, no QK norm, optional llama3 RoPE scaling."""

from __future__ import annotations

from loong.llm.models.hf_config import HFFamily

FAMILY = HFFamily(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_type="llama",
    qkv_bias=False,
    qk_norm=False,
    max_position_default=2048,
)

config_from_hf = FAMILY.config_from_hf
hf_config_dict = FAMILY.hf_config_dict

__all__ = ["FAMILY", "config_from_hf", "hf_config_dict"]
