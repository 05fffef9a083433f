"""DeepSeek-V3.2: what exists so far — its config.json translation (DeepSeek-V3's plus the lightning indexer's
fields, both ways) and a one-line error, before anything heavy, where a model would need the sparse attention."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import DeepseekV32Config

from loong.core.config.schema import ParallelConfig
from loong.core.errors import LoongError
from loong.llm.models.build import transformer_config
from loong.llm.models.config import training_flops_per_token
from loong.llm.models.hf_mapping import family_for_hf_config


def tiny_v32_hf() -> dict:
    return DeepseekV32Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=4, first_k_dense_replace=1, index_topk=8, index_head_dim=16, index_n_heads=2,
    ).to_dict()


def test_config_translation_both_ways():
    hf = tiny_v32_hf()
    fam = family_for_hf_config(hf)
    cfg = fam.config_from_hf(hf)
    assert (fam.name, cfg.family, cfg.is_dsa, cfg.is_mla) == ("deepseek_v32", "deepseek_v32", True, True)
    assert (cfg.index_topk, cfg.index_head_dim, cfg.index_n_heads, cfg.first_k_dense_replace) == (8, 16, 2, 1)
    out = fam.hf_config_dict(cfg, "float32")
    assert out["architectures"] == ["DeepseekV32ForCausalLM"]
    assert out["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert fam.config_from_hf(out) == cfg
    with pytest.raises(LoongError, match="mlp_layer_types"):
        fam.config_from_hf({**hf, "mlp_layer_types": ["sparse", "dense", "sparse"]})
    # the indexer is in the parameter count and the FLOPs (sparse attention: top-k keys per query)
    v3 = dataclasses.replace(cfg, family="deepseek_v3")
    assert cfg.num_parameters() > v3.num_parameters()
    assert training_flops_per_token(cfg, 64) != training_flops_per_token(v3, 64)


def test_building_says_sparse_attention_is_not_there_yet():
    import torch

    cfg = family_for_hf_config(tiny_v32_hf()).config_from_hf(tiny_v32_hf())
    with pytest.raises(LoongError, match="DeepSeek Sparse Attention"):
        cfg.validate("model")
    with pytest.raises(LoongError, match="not implemented yet"):
        transformer_config(cfg, ParallelConfig(), torch.float32)
