"""Qwen2.5-VL and Qwen3-VL (dense and MoE) vision sides against transformers' own modules, on CPU in fp32.

The oracle is HF's ``model.visual`` module (``Qwen2_5_VisionTransformerPretrainedModel``, ``Qwen3VLVisionModel``,
``Qwen3VLMoeVisionModel``) built in-process from a tiny config with seeded random weights. A batch holds images of
different sizes and a video (t > 1); the Qwen2.5-VL config has windows of 2×2 merge units, so the images split into
several windows, partial ones at the edges, and one block attends over whole frames.
"""

from __future__ import annotations

import dataclasses
import os
from importlib.resources import files

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

from loong.core.config.schema import from_dict
from loong.core.errors import LoongError
from loong.vlm.models import qwen2_5_vl, qwen3_vl
from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.qwen2_5_vl.vision import window_layout
from loong.vlm.models.vision.common import grid_list

TOL = 1e-5
# three images (one smaller than a window, two with partial windows) and a 3-frame video
GRID = torch.tensor([[1, 10, 14], [1, 6, 4], [1, 2, 2], [3, 8, 6]])
TINY = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
            temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=24)
TINY_25 = dict(TINY, window_size=16, fullatt_block_indexes=[1])  # windows of 16 px = 2x2 merge units
TINY_3 = dict(TINY, num_position_embeddings=36, deepstack_visual_indexes=[0, 2])  # a 6x6 position grid
TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            intermediate_size=64, vocab_size=151936)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights far from HF's init (norms around 1, everything else N(0, 0.1))."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_norm_weight = ("norm" in name or "ln_q" in name) and name.endswith("weight")
            p.copy_(1 + 0.1 * noise if is_norm_weight else 0.1 * noise)


def pixels(cfg: dict, grid: torch.Tensor, seed: int = 1) -> torch.Tensor:
    n = int(grid.prod(-1).sum())
    dim = cfg["in_channels"] * cfg["temporal_patch_size"] * cfg["patch_size"] ** 2
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def loong_pair(fam, hf_model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, EncoderConfig,
                                                         ProjectorConfig]:
    """Loong's encoder and projector from ``hf_model``'s config, loaded with its weights through the mapping."""
    enc_cfg = fam.enc_cfg_from_hf(hf_model.config.to_dict())
    proj_cfg = fam.proj_cfg_from_hf(hf_model.config.to_dict())
    enc, proj = fam.build_encoder(enc_cfg), fam.build_projector(proj_cfg, enc_cfg)
    native = fam.hf_to_native(hf_model.state_dict(), enc_cfg, proj_cfg)
    enc.load_state_dict({k.removeprefix("encoder."): v for k, v in native.items() if k.startswith("encoder.")})
    proj.load_state_dict({k.removeprefix("projector."): v for k, v in native.items() if k.startswith("projector.")})
    return enc, proj, enc_cfg, proj_cfg


def native_grads(enc: torch.nn.Module, proj: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**{f"encoder.{k}": p.grad for k, p in enc.named_parameters()},
            **{f"projector.{k}": p.grad for k, p in proj.named_parameters()}}


def hf_qwen2_5(seed: int = 0) -> Qwen2_5_VisionTransformerPretrainedModel:
    cfg = Qwen2_5_VLVisionConfig(**TINY_25)
    cfg._attn_implementation = "sdpa"
    model = Qwen2_5_VisionTransformerPretrainedModel(cfg)
    randomize(model, seed)
    return model


def hf_qwen3(cls: type = Qwen3VLVisionModel, config_cls: type = Qwen3VLVisionConfig,
             seed: int = 0) -> torch.nn.Module:
    cfg = config_cls(**TINY_3)
    cfg._attn_implementation = "sdpa"
    model = cls(cfg)
    randomize(model, seed)
    return model


# ------------------------------------------------------------------------------------------------- parity

def test_qwen2_5_windows_cover_the_cases() -> None:
    """The parity batch exercises several windows per frame, partial windows and an image below window size."""
    cfg = qwen2_5_vl.enc_cfg_from_hf(Qwen2_5_VLVisionConfig(**TINY_25).to_dict())
    grid = grid_list(GRID, 2)
    _, ids = window_layout(grid, 2, 2, torch.device("cpu"))
    sizes = torch.bincount(ids).tolist()
    assert len(sizes) == 12 + 2 + 1 + 3 * 4  # windows: 10x14 -> 3x4, 6x4 -> 2x1, 2x2 -> 1, 8x6 -> 2x2 per frame
    assert max(sizes) == 16 and {4, 8} <= set(sizes)  # full 4x4-patch windows and partial ones
    assert cfg.fullatt_block_indexes == [1] and cfg.depth == 3


def test_qwen2_5_forward_and_grads_match_hf() -> None:
    hf = hf_qwen2_5()
    enc, proj, enc_cfg, proj_cfg = loong_pair(qwen2_5_vl, hf)
    px = pixels(TINY_25, GRID)
    ref = hf(px, grid_thw=GRID).pooler_output
    out = proj(enc(px, GRID), GRID)
    assert out.embeds.shape == ref.shape == (int(GRID.prod(-1).sum()) // 4, TINY["out_hidden_size"])
    assert out.deepstack == []
    assert rel(out.embeds, ref) <= TOL

    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    (ref * weight).sum().backward()
    (out.embeds * weight).sum().backward()
    grads = qwen2_5_vl.native_to_hf(native_grads(enc, proj), enc_cfg, proj_cfg)
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    assert grads.keys() == hf_grads.keys()
    for key in ("patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias",
                "blocks.1.mlp.gate_proj.weight", "merger.mlp.0.weight"):
        assert rel(grads[key], hf_grads[key]) <= TOL, key
    assert max(rel(grads[k], hf_grads[k]) for k in grads) <= TOL


def test_qwen3_forward_deepstack_and_grads_match_hf() -> None:
    hf = hf_qwen3()
    enc, proj, enc_cfg, proj_cfg = loong_pair(qwen3_vl, hf)
    px = pixels(TINY_3, GRID)
    ref = hf(px, grid_thw=GRID)
    out = proj(enc(px, GRID), GRID)
    assert len(out.deepstack) == len(ref.deepstack_features) == 2
    assert rel(out.embeds, ref.pooler_output) <= TOL
    for mine, theirs in zip(out.deepstack, ref.deepstack_features, strict=True):
        assert mine.shape == theirs.shape and rel(mine, theirs) <= TOL

    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(ref.pooler_output.shape, generator=g) for _ in range(3)]

    def loss(embeds: torch.Tensor, deepstack: list[torch.Tensor]) -> torch.Tensor:
        return sum(((t * w).sum() for t, w in zip([embeds, *deepstack], weights, strict=True)), torch.tensor(0.0))

    loss(ref.pooler_output, ref.deepstack_features).backward()
    loss(out.embeds, out.deepstack).backward()
    grads = qwen3_vl.native_to_hf(native_grads(enc, proj), enc_cfg, proj_cfg)
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    assert grads.keys() == hf_grads.keys()
    for key in ("patch_embed.proj.weight", "pos_embed.weight", "blocks.0.attn.qkv.weight",
                "deepstack_merger_list.0.linear_fc1.weight", "merger.norm.weight"):
        assert rel(grads[key], hf_grads[key]) <= TOL, key
    assert max(rel(grads[k], hf_grads[k]) for k in grads) <= TOL


def test_qwen3_moe_visual_is_the_same_module() -> None:
    """Qwen3-VL-MoE's ``Qwen3VLMoeVisionModel`` takes the dense model's keys and gives the same outputs as Loong."""
    dense = hf_qwen3()
    moe = hf_qwen3(Qwen3VLMoeVisionModel, Qwen3VLMoeVisionConfig, seed=5)
    moe.load_state_dict(dense.state_dict(), strict=True)
    enc, proj, enc_cfg, _ = loong_pair(qwen3_vl, dense)
    assert qwen3_vl.enc_cfg_from_hf(moe.config.to_dict()) == enc_cfg
    px = pixels(TINY_3, GRID)
    ref = moe(px, grid_thw=GRID)
    out = proj(enc(px, GRID), GRID)
    assert rel(out.embeds, ref.pooler_output) <= TOL
    assert all(rel(a, b) <= TOL for a, b in zip(out.deepstack, ref.deepstack_features, strict=True))


def test_recompute_gives_the_same_gradients() -> None:
    hf = hf_qwen2_5()
    px = pixels(TINY_25, GRID)
    grads = []
    for recompute in (False, True):
        enc, proj, _, _ = loong_pair(qwen2_5_vl, hf)
        enc.recompute = recompute
        enc.train()
        proj(enc(px, GRID), GRID).embeds.square().sum().backward()
        grads.append(enc.blocks[0].attn.qkv.weight.grad)
    assert torch.equal(grads[0], grads[1])


# ----------------------------------------------------------------------------------------------- mappings

@pytest.mark.parametrize("fam, make", [(qwen2_5_vl, hf_qwen2_5), (qwen3_vl, hf_qwen3)], ids=["qwen2_5", "qwen3"])
def test_round_trip_is_bit_exact(fam, make) -> None:
    hf = make()
    enc, proj, enc_cfg, proj_cfg = loong_pair(fam, hf)
    state = hf.state_dict()
    native = fam.hf_to_native(state, enc_cfg, proj_cfg)
    assert native.keys() == {f"encoder.{k}" for k in enc.state_dict()} | {f"projector.{k}" for k in proj.state_dict()}
    back = fam.native_to_hf(native, enc_cfg, proj_cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("fam, make", [(qwen2_5_vl, hf_qwen2_5), (qwen3_vl, hf_qwen3)], ids=["qwen2_5", "qwen3"])
def test_mapping_refuses_a_mismatched_state(fam, make) -> None:
    hf = make()
    enc_cfg, proj_cfg = fam.enc_cfg_from_hf(hf.config.to_dict()), fam.proj_cfg_from_hf(hf.config.to_dict())
    state = dict(hf.state_dict())
    del state["blocks.2.attn.proj.bias"]
    state["blocks.3.attn.proj.bias"] = torch.zeros(1)
    with pytest.raises(LoongError, match=r"missing \['blocks.2.attn.proj.bias'\].*unexpected \['blocks.3"):
        fam.hf_to_native(state, enc_cfg, proj_cfg)


def _composite_visual_keys(model_cls: type, config: object) -> set[str]:
    with torch.device("meta"):
        model = model_cls(config)
    return {k.removeprefix("model.visual.") for k in model.state_dict() if k.startswith("model.visual.")}


@pytest.mark.parametrize("case", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_keys_are_those_under_model_visual_of_the_composite_model(case: str) -> None:
    if case == "qwen2_5_vl":
        fam, vision = qwen2_5_vl, TINY_25
        keys = _composite_visual_keys(Qwen2_5_VLForConditionalGeneration,
                                      Qwen2_5_VLConfig(text_config=TEXT, vision_config=vision))
    elif case == "qwen3_vl":
        fam, vision = qwen3_vl, TINY_3
        keys = _composite_visual_keys(Qwen3VLForConditionalGeneration,
                                      Qwen3VLConfig(text_config=TEXT, vision_config=vision))
    else:
        fam, vision = qwen3_vl, TINY_3
        text = dict(TEXT, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16)
        keys = _composite_visual_keys(Qwen3VLMoeForConditionalGeneration,
                                      Qwen3VLMoeConfig(text_config=text, vision_config=vision))
    enc_cfg, proj_cfg = fam.enc_cfg_from_hf(vision), fam.proj_cfg_from_hf(vision)
    assert {r.hf for r in fam.mapping.rules(enc_cfg, proj_cfg)} == keys


# ------------------------------------------------------------------------------------ presets and configs

#: published ``vision_config`` values (transformers' names) and the foundation's hidden size of each preset
PUBLISHED_25 = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, patch_size=14,
                    temporal_patch_size=2, spatial_merge_size=2, hidden_act="silu", window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31])
PUBLISHED_3_SMALL = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, in_channels=3,
                         patch_size=16, temporal_patch_size=2, spatial_merge_size=2, hidden_act="gelu_pytorch_tanh",
                         num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17])
PUBLISHED_3_LARGE = dict(PUBLISHED_3_SMALL, depth=27, hidden_size=1152, intermediate_size=4304,
                         deepstack_visual_indexes=[8, 16, 24])
PUBLISHED = {
    "qwen2_5_vl_3b": (qwen2_5_vl, PUBLISHED_25, 2048),
    "qwen2_5_vl_7b": (qwen2_5_vl, PUBLISHED_25, 3584),
    "qwen2_5_vl_72b": (qwen2_5_vl, PUBLISHED_25, 8192),
    "qwen3_vl_2b": (qwen3_vl, PUBLISHED_3_SMALL, 2048),
    "qwen3_vl_8b": (qwen3_vl, PUBLISHED_3_LARGE, 4096),
    "qwen3_vl_30b_a3b": (qwen3_vl, PUBLISHED_3_LARGE, 2048),
}
HF_VISION = {qwen2_5_vl: (Qwen2_5_VLVisionConfig, Qwen2_5_VisionTransformerPretrainedModel),
             qwen3_vl: (Qwen3VLVisionConfig, Qwen3VLVisionModel)}
ARCH_FIELDS = [f.name for f in dataclasses.fields(EncoderConfig)
               if f.name not in ("preset", "init_std", "init_from", "recompute", "decoupled", "parallel")]


def load_preset(group: str, name: str, foundation_hidden: int) -> EncoderConfig | ProjectorConfig:
    """A preset yaml of ``group`` as its dataclass, ``${foundation.hidden_size}`` resolved."""
    text = (files("loong.vlm.configs") / group / f"{name}.yaml").read_text()
    node = OmegaConf.create({"foundation": {"hidden_size": foundation_hidden}, group: OmegaConf.create(text)})
    data = OmegaConf.to_container(node, resolve=True)[group]
    return from_dict(EncoderConfig if group == "encoder" else ProjectorConfig, data, group)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_published_presets_match_hf_parameter_counts(preset: str) -> None:
    fam, vision, out_hidden = PUBLISHED[preset]
    config_cls, model_cls = HF_VISION[fam]
    enc_cfg = load_preset("encoder", preset, out_hidden)
    proj_cfg = load_preset("projector", preset, out_hidden)
    assert proj_cfg.out_hidden_size == out_hidden
    published = fam.enc_cfg_from_hf(dict(vision, out_hidden_size=out_hidden))
    assert {f: getattr(enc_cfg, f) for f in ARCH_FIELDS} == {f: getattr(published, f) for f in ARCH_FIELDS}
    with torch.device("meta"):
        hf = model_cls(config_cls(**vision, out_hidden_size=out_hidden))
        enc, proj = fam.build_encoder(enc_cfg), fam.build_projector(proj_cfg, enc_cfg)
    analytic = fam.encoder_num_parameters(enc_cfg) + fam.projector_num_parameters(proj_cfg, enc_cfg)
    assert analytic == count(enc) + count(proj) == count(hf)
    assert fam.encoder_num_parameters(enc_cfg) == count(enc)


@pytest.mark.parametrize("enc_name, proj_name, fam", [("qwen2_5_vit_tiny", "qwen2_5_merger_tiny", qwen2_5_vl),
                                                      ("qwen3_vit_tiny", "qwen3_merger_tiny", qwen3_vl)])
def test_tiny_presets_build_and_run(enc_name: str, proj_name: str, fam) -> None:
    enc_cfg, proj_cfg = load_preset("encoder", enc_name, 128), load_preset("projector", proj_name, 128)
    enc, proj = fam.build_encoder(enc_cfg), fam.build_projector(proj_cfg, enc_cfg)
    grid = torch.tensor([[1, 16, 16], [2, 8, 12]])
    dim = enc_cfg.in_channels * enc_cfg.temporal_patch_size * enc_cfg.patch_size ** 2
    out = proj(enc(torch.randn(int(grid.prod(-1).sum()), dim), grid), grid)
    assert out.embeds.shape == (64 + 48, 128)
    assert len(out.deepstack) == len(enc_cfg.deepstack_visual_indexes)
    assert fam.encoder_num_parameters(enc_cfg) == count(enc)


@pytest.mark.parametrize("preset", [*PUBLISHED, "qwen2_5_vit_tiny", "qwen3_vit_tiny"])
def test_hf_vision_config_round_trip(preset: str) -> None:
    fam = qwen2_5_vl if preset.startswith("qwen2_5") else qwen3_vl
    proj_name = {"qwen2_5_vit_tiny": "qwen2_5_merger_tiny", "qwen3_vit_tiny": "qwen3_merger_tiny"}.get(preset, preset)
    enc_cfg, proj_cfg = load_preset("encoder", preset, 1536), load_preset("projector", proj_name, 1536)
    hf_dict = fam.hf_vision_config(enc_cfg, proj_cfg)
    config_cls = HF_VISION[fam][0]
    through_hf = config_cls(**{k: v for k, v in hf_dict.items() if k != "model_type"}).to_dict()
    for d in (hf_dict, through_hf):
        back = fam.enc_cfg_from_hf(d)
        assert {f: getattr(back, f) for f in ARCH_FIELDS} == {f: getattr(enc_cfg, f) for f in ARCH_FIELDS}
        assert fam.proj_cfg_from_hf(d) == dataclasses.replace(proj_cfg, init_std=enc_cfg.init_std)


def test_published_config_json_names_are_read() -> None:
    """Qwen2.5-VL's published config.json spells the channels ``in_chans``; a missing field names its key."""
    cfg = qwen2_5_vl.enc_cfg_from_hf({**{k: v for k, v in PUBLISHED_25.items() if k != "in_channels"},
                                      "in_chans": 1})
    assert cfg.in_channels == 1
    with pytest.raises(LoongError, match=r"vision_config\.window_size"):
        qwen2_5_vl.enc_cfg_from_hf({k: v for k, v in PUBLISHED_25.items() if k != "window_size"})
    with pytest.raises(LoongError, match="projector.hidden_act"):
        qwen3_vl.hf_vision_config(qwen3_vl.enc_cfg_from_hf(PUBLISHED_3_SMALL),
                                  ProjectorConfig(family="qwen3_merger", hidden_act="silu"))


# ---------------------------------------------------------------------------------------------------- FLOPs

def hf_flops(model: torch.nn.Module, px: torch.Tensor, grid: torch.Tensor) -> int:
    """FLOPs of HF's forward as torch counts them (the math SDPA backend, so attention is counted as bmm)."""
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(px, grid_thw=grid)
    return counter.get_total_flops()


@pytest.mark.parametrize("fam, make, cfg", [(qwen2_5_vl, hf_qwen2_5, TINY_25), (qwen3_vl, hf_qwen3, TINY_3)],
                         ids=["qwen2_5", "qwen3"])
def test_flops_match_hf_counted_flops(fam, make, cfg) -> None:
    hf = make()
    enc_cfg, proj_cfg = fam.enc_cfg_from_hf(hf.config.to_dict()), fam.proj_cfg_from_hf(hf.config.to_dict())
    n = int(GRID.prod(-1).sum())
    mine = sum(fam.encoder_flops(enc_cfg, GRID)) + n * fam.projector_flops_per_patch(proj_cfg, enc_cfg)
    assert mine == hf_flops(hf, pixels(cfg, GRID), GRID)
    # an image tiled exactly by whole windows (8x8 patches = 2x2 windows of 4x4): the a·n² + b·n model is exact
    grid = torch.tensor([[1, 8, 8]])
    cost = fam.encoder_cost(enc_cfg)
    assert cost(64) == fam.encoder_flops(enc_cfg, grid)[0]
    assert cost(64) + 64 * fam.projector_flops_per_patch(proj_cfg, enc_cfg) == hf_flops(hf, pixels(cfg, grid), grid)


# ------------------------------------------------------------------------------------------------ bad input

def test_bad_inputs_are_clear_errors() -> None:
    hf = hf_qwen2_5()
    enc, _, enc_cfg, _ = loong_pair(qwen2_5_vl, hf)
    px = pixels(TINY_25, GRID)
    with pytest.raises(LoongError, match=r"pixel_values: expected \[\d+, 96\]"):
        enc(px[:-1], GRID)
    with pytest.raises(LoongError, match=r"grid_thw\[0\].*multiples of the spatial merge size 2"):
        enc(px, torch.tensor([[1, 5, 4]]))
    with pytest.raises(LoongError, match=r"encoder.window_size=4"):
        qwen2_5_vl.build_encoder(dataclasses.replace(enc_cfg, window_size=4))
    with pytest.raises(LoongError, match=r"encoder.hidden_act"):
        qwen2_5_vl.build_encoder(dataclasses.replace(enc_cfg, hidden_act="swish9"))
    q3 = qwen3_vl.enc_cfg_from_hf(TINY_3)
    with pytest.raises(LoongError, match=r"num_position_embeddings: 35 is not a square"):
        qwen3_vl.build_encoder(dataclasses.replace(q3, num_position_embeddings=35))
    with pytest.raises(LoongError, match=r"deepstack_visual_indexes.*strictly increasing"):
        qwen3_vl.build_encoder(dataclasses.replace(q3, deepstack_visual_indexes=[2, 0]))


def test_qkv_layout_shards_by_heads() -> None:
    """Two column shards of ``qkv`` (contiguous rows) and row shards of ``proj`` add up to the whole attention:
    the per-head ``[heads, 3, head_dim]`` layout a tensor-parallel pass relies on."""
    enc, _, _, _ = loong_pair(qwen3_vl, hf_qwen3())
    attn = enc.blocks[1].attn
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([0] * 12 + [1] * 8)
    whole = attn(x, ids)
    parts = []
    for rank in range(2):
        shard = type(attn)(32, 2)
        rows, cols = slice(48 * rank, 48 * (rank + 1)), slice(16 * rank, 16 * (rank + 1))
        # rank's shard: qkv rows of one head ([48, 32]), proj columns of that head, proj bias on rank 0 only
        shard.qkv.weight = torch.nn.Parameter(attn.qkv.weight[rows].detach().clone())
        shard.qkv.bias = torch.nn.Parameter(attn.qkv.bias[rows].detach().clone())
        shard.proj.weight = torch.nn.Parameter(attn.proj.weight[:, cols].detach().clone())
        shard.proj.bias = torch.nn.Parameter(attn.proj.bias.detach().clone() * (rank == 0))
        parts.append(shard(x, ids))
    assert rel(parts[0] + parts[1], whole) <= TOL
