"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3 plus DeepSeek Sparse Attention (DSA) — a lightning
indexer (``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``) scores every earlier key per query, the
``index_topk`` best are kept and MLA attends over those only. The attention module is in :mod:`.attention`, the
indexer and its loss in :mod:`.indexer`, the tensor mapping in :mod:`.mapping`; config translation extends
DeepSeek-V3's with the indexer fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig
from loong.llm.models.deepseek_v3 import DeepSeekHFFamily


@dataclass(frozen=True)
class DeepSeekV32HFFamily(DeepSeekHFFamily):
    """DeepSeek-V3's config.json translation plus ``index_n_heads``, ``index_head_dim``, ``index_topk``."""

    def config_from_hf(self, hf: dict[str, Any]) -> DenseModelConfig:
        types = hf.get("mlp_layer_types")
        n_dense = int(hf.get("first_k_dense_replace") or 0)
        if types is not None and list(types) != ["dense"] * n_dense + ["sparse"] * (len(types) - n_dense):
            raise LoongError(f"{self.architectures[0]} config: mlp_layer_types={types} is not first_k_dense_replace "
                             "dense layers followed by sparse ones")
        cfg = super().config_from_hf(hf)
        cfg.index_n_heads = int(hf.get("index_n_heads", 64))
        cfg.index_head_dim = int(hf.get("index_head_dim", 128))
        cfg.index_topk = int(hf.get("index_topk", 2048))
        return cfg

    def hf_config_dict(self, cfg: DenseModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
        out = super().hf_config_dict(cfg, dtype)
        n_dense = cfg.num_dense_layers
        out.update(index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
                   mlp_layer_types=["dense"] * n_dense + ["sparse"] * (cfg.num_layers - n_dense), mlp_bias=False)
        return out


FAMILY = DeepSeekV32HFFamily(
    name="deepseek_v32",
    architectures=("DeepseekV32ForCausalLM",),
    model_type="deepseek_v32",
    qkv_bias=False,
    qk_norm=False,
    max_position_default=163840,
)

config_from_hf = FAMILY.config_from_hf
hf_config_dict = FAMILY.hf_config_dict

__all__ = ["FAMILY", "DeepSeekV32HFFamily", "config_from_hf", "hf_config_dict"]
