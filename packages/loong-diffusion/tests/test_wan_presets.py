"""Wan presets: parameter counts against the published checkpoints and diffusers' model of the same config (both
built on the meta device, nothing allocated), the 3-D RoPE split, the A14B expert switch, and config checks."""

from __future__ import annotations

import pytest
import torch

from loong.core.errors import LoongError
from loong.diffusion.models.wan import PRESETS, WanConfig, WanTransformer, config_to_diffusers, wan_preset

#: parameters of one expert of the published ``Wan-AI/*-Diffusers`` transformers (the sum of their safetensors
#: tensors' elements as public records give them); I2V-14B and FLF2V-14B are diffusers' count of their published
#: config (no public record of the sum was found), 14.29B of the T2V-14B plus the image branch
PUBLISHED = {
    "wan2_1_t2v_1_3b": 1_418_996_800,
    "wan2_1_t2v_14b": 14_288_491_584,
    "wan2_1_i2v_14b": 16_394_878_784,
    "wan2_1_flf2v_14b": 16_395_536_704,
    "wan2_2_ti2v_5b": 4_999_787_712,
    "wan2_2_t2v_a14b": 14_288_491_584,
    "wan2_2_i2v_a14b": 14_288_901_184,
}
#: the sizes in the published names (A14B: the active parameters of a step; its two experts hold 27B)
NOMINAL = {"wan2_1_t2v_1_3b": 1.3e9, "wan2_1_t2v_14b": 14e9, "wan2_2_ti2v_5b": 5e9, "wan2_2_t2v_a14b": 14e9,
           "wan2_2_i2v_a14b": 14e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_of_the_published_shapes(name: str) -> None:
    from diffusers import WanTransformer3DModel

    config = wan_preset(name)
    with torch.device("meta"):
        ours = WanTransformer(config)
        theirs = WanTransformer3DModel(**{k: v for k, v in config_to_diffusers(config).items()
                                          if not k.startswith("_")})
    counted = sum(p.numel() for p in theirs.parameters())
    assert config.num_parameters(active=True) == ours.num_parameters() == counted == PUBLISHED[name]
    assert config.num_parameters() == config.experts * PUBLISHED[name]
    if name in NOMINAL:
        assert abs(counted - NOMINAL[name]) / NOMINAL[name] < 0.1, counted


def test_a14b_pairs_are_two_wan21_14b_experts() -> None:
    t2v, i2v = wan_preset("wan2_2_t2v_a14b"), wan_preset("wan2_2_i2v_a14b")
    assert t2v.replace(experts=1, boundary_ratio=None) == wan_preset("wan2_1_t2v_14b")
    assert 27e9 < t2v.num_parameters() < 29e9
    # diffusers' pipelines: the high-noise expert (``transformer``) while t >= boundary_ratio * 1000
    assert [t2v.expert_for(t) for t in (999.0, 875.0, 874.9, 0.0)] == ["high_noise", "high_noise", "low_noise",
                                                                         "low_noise"]
    assert i2v.expert_for(900.0) == "high_noise" and i2v.expert_for(899.0) == "low_noise"
    assert i2v.in_channels == 36 and i2v.image_dim is None  # Wan 2.2 I2V has no CLIP branch
    with pytest.raises(LoongError, match="has one expert"):
        wan_preset("tiny").expert_for(500.0)


def test_rope_split_of_the_head() -> None:
    assert wan_preset("wan2_1_t2v_14b").rope_dims == (44, 42, 42)
    assert wan_preset("tiny").rope_dims == (8, 4, 4)


def test_every_preset_builds_its_published_layout_on_meta() -> None:
    for name, config in PRESETS.items():
        with torch.device("meta"):
            model = WanTransformer(config)
        assert model.num_parameters() == config.num_parameters(active=True), name
        assert (model.blocks[0].cross_attn.image_kv is not None) == (config.image_dim is not None), name


def test_bad_configs_and_names_fail_clearly() -> None:
    with pytest.raises(LoongError, match="did you mean 'wan2_1_t2v_14b'"):
        wan_preset("wan2_1_t2v_14")
    with pytest.raises(LoongError, match="image_dim and model.added_kv_proj_dim go together"):
        WanConfig(num_heads=2, head_dim=16, ffn_dim=8, num_layers=1, image_dim=8)
    with pytest.raises(LoongError, match="added_kv_proj_dim projects the embedded image tokens"):
        WanConfig(num_heads=2, head_dim=16, ffn_dim=8, num_layers=1, image_dim=8, added_kv_proj_dim=16)
    with pytest.raises(LoongError, match="boundary_ratio switches between two experts"):
        WanConfig(num_heads=2, head_dim=16, ffn_dim=8, num_layers=1, experts=2)
    with pytest.raises(LoongError, match="qk_norm must be"):
        WanConfig(num_heads=2, head_dim=16, ffn_dim=8, num_layers=1, qk_norm="rms_norm")
