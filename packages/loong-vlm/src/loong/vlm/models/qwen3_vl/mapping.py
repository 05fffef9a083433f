"""Hugging Face mapping of Qwen3-VL's vision side (dense and MoE: the same module and keys), declared once.

HF keys are relative to ``model.visual.`` of ``Qwen3VLForConditionalGeneration`` /
``Qwen3VLMoeForConditionalGeneration`` (transformers 5.x layout, as the published safetensors name them), i.e.
the state dict of ``Qwen3VLVisionModel`` / ``Qwen3VLMoeVisionModel``. ``merger.*`` and
``deepstack_merger_list.*`` map to ``projector.*``, the rest to ``encoder.*``:

=========================================  =============================================  =======================
HF (``model.visual.``)                     native                                         transform
=========================================  =============================================  =======================
``patch_embed.proj.{weight,bias}``         ``encoder.patch_embed.{weight,bias}``          Conv3d ↔ Linear reshape
``pos_embed.weight``                       ``encoder.pos_embed.weight``
``blocks.{i}.norm{1,2}.{weight,bias}``     ``encoder.blocks.{i}.norm{1,2}.*``
``blocks.{i}.attn.qkv.{weight,bias}``      ``encoder.blocks.{i}.attn.qkv.*``              ``[3,h,hd]`` ↔ ``[h,3,hd]``
``blocks.{i}.attn.proj.*``                 ``encoder.blocks.{i}.attn.proj.*``
``blocks.{i}.mlp.linear_fc{1,2}.*``        ``encoder.blocks.{i}.mlp.fc{1,2}.*``
``merger.{norm,linear_fc1,linear_fc2}.*``  ``projector.merger.{norm,fc1,fc2}.*``
``deepstack_merger_list.{j}.*``            ``projector.deepstack.{j}.*`` (same inner names)
=========================================  =============================================  =======================

The config side: :func:`enc_cfg_from_hf` / :func:`proj_cfg_from_hf` read an HF ``vision_config`` dict,
:func:`hf_vision_config` writes one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from loong.core.errors import LoongError
from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.vision.common import KeyRule, conv_to_linear, hf_value, map_state, qkv_hf_to_native

#: HF's LayerNorms in this ViT and its mergers are built with this epsilon (not read from the config)
HF_NORM_EPS = 1e-6

_WB = ("weight", "bias")


def _merger_rules(hf: str, nat: str) -> list[KeyRule]:
    pairs = (("norm", "norm"), ("linear_fc1", "fc1"), ("linear_fc2", "fc2"))
    return [KeyRule(f"{hf}{h}.{s}", f"{nat}{n}.{s}") for h, n in pairs for s in _WB]


def rules(enc_cfg: EncoderConfig, proj_cfg: ProjectorConfig) -> list[KeyRule]:
    """Every tensor of the vision side, HF key ↔ native key."""
    c, t, p = enc_cfg.in_channels, enc_cfg.temporal_patch_size, enc_cfg.patch_size
    patch_to_native, patch_to_hf = conv_to_linear((enc_cfg.hidden_size, c, t, p, p))
    qkv_to_native, qkv_to_hf = qkv_hf_to_native(enc_cfg.num_heads)
    out = [KeyRule("patch_embed.proj.weight", "encoder.patch_embed.weight", patch_to_native, patch_to_hf),
           KeyRule("patch_embed.proj.bias", "encoder.patch_embed.bias"),
           KeyRule("pos_embed.weight", "encoder.pos_embed.weight")]
    for i in range(enc_cfg.depth):
        hf, nat = f"blocks.{i}.", f"encoder.blocks.{i}."
        out += [KeyRule(f"{hf}{n}.{s}", f"{nat}{n}.{s}") for n in ("norm1", "norm2") for s in _WB]
        qkv = _WB if enc_cfg.qkv_bias else ("weight",)
        out += [KeyRule(f"{hf}attn.qkv.{s}", f"{nat}attn.qkv.{s}", qkv_to_native, qkv_to_hf) for s in qkv]
        out += [KeyRule(f"{hf}attn.proj.{s}", f"{nat}attn.proj.{s}") for s in _WB]
        out += [KeyRule(f"{hf}mlp.linear_{n}.{s}", f"{nat}mlp.{n}.{s}") for n in ("fc1", "fc2") for s in _WB]
    out += _merger_rules("merger.", "projector.merger.")
    for j in range(len(enc_cfg.deepstack_visual_indexes)):
        out += _merger_rules(f"deepstack_merger_list.{j}.", f"projector.deepstack.{j}.")
    return out


def hf_to_native(hf_state: Mapping[str, torch.Tensor], enc_cfg: EncoderConfig,
                 proj_cfg: ProjectorConfig) -> dict[str, torch.Tensor]:
    """HF ``model.visual.*`` tensors (prefix stripped) -> native ``encoder.*`` / ``projector.*`` tensors."""
    return map_state(hf_state, rules(enc_cfg, proj_cfg), to_native=True, where="qwen3_vl vision (HF -> Loong)")


def native_to_hf(native: Mapping[str, torch.Tensor], enc_cfg: EncoderConfig,
                 proj_cfg: ProjectorConfig) -> dict[str, torch.Tensor]:
    """Native ``encoder.*`` / ``projector.*`` tensors -> HF keys relative to ``model.visual.``."""
    return map_state(native, rules(enc_cfg, proj_cfg), to_native=False, where="qwen3_vl vision (Loong -> HF)")


def _rope_theta(hf: Mapping) -> float:
    rope = hf.get("rope_parameters") or {}
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def enc_cfg_from_hf(hf: Mapping) -> EncoderConfig:
    """``EncoderConfig`` (family ``qwen3_vit``) from an HF Qwen3-VL / Qwen3-VL-MoE ``vision_config`` dict."""
    return EncoderConfig(
        family="qwen3_vit",
        depth=int(hf_value(hf, "depth", "num_hidden_layers")),
        hidden_size=int(hf_value(hf, "hidden_size")),
        intermediate_size=int(hf_value(hf, "intermediate_size")),
        num_heads=int(hf_value(hf, "num_heads", "num_attention_heads")),
        in_channels=int(hf_value(hf, "in_channels", default=3)),
        patch_size=int(hf_value(hf, "patch_size")),
        temporal_patch_size=int(hf_value(hf, "temporal_patch_size", default=2)),
        spatial_merge_size=int(hf_value(hf, "spatial_merge_size", default=2)),
        hidden_act=str(hf_value(hf, "hidden_act", default="gelu_pytorch_tanh")),
        norm_eps=HF_NORM_EPS,
        qkv_bias=True,
        rope_theta=_rope_theta(hf),
        num_position_embeddings=int(hf_value(hf, "num_position_embeddings")),
        deepstack_visual_indexes=[int(i) for i in hf_value(hf, "deepstack_visual_indexes", default=[])],
        init_std=float(hf_value(hf, "initializer_range", default=0.02)),
    )


def proj_cfg_from_hf(hf: Mapping) -> ProjectorConfig:
    """``ProjectorConfig`` (family ``qwen3_merger``) from an HF Qwen3-VL ``vision_config`` dict."""
    return ProjectorConfig(family="qwen3_merger", out_hidden_size=int(hf_value(hf, "out_hidden_size")),
                           hidden_size=0, hidden_act="gelu",
                           init_std=float(hf_value(hf, "initializer_range", default=0.02)))


def check_hf_compatible(enc_cfg: EncoderConfig, proj_cfg: ProjectorConfig) -> None:
    """Refuse what HF's modules cannot express (they fix the norm epsilon, the qkv bias, the mergers' shape and
    activation)."""
    problems = []
    if enc_cfg.norm_eps != HF_NORM_EPS:
        problems.append(f"encoder.norm_eps={enc_cfg.norm_eps} (HF uses {HF_NORM_EPS})")
    if not enc_cfg.qkv_bias:
        problems.append("encoder.qkv_bias=false (HF's qkv has a bias)")
    h = enc_cfg.hidden_size * enc_cfg.spatial_merge_size ** 2
    if proj_cfg.hidden_size not in (0, h):
        problems.append(f"projector.hidden_size={proj_cfg.hidden_size} (HF's mergers are {h} wide)")
    if proj_cfg.hidden_act != "gelu":
        problems.append(f"projector.hidden_act={proj_cfg.hidden_act!r} (HF's mergers use gelu)")
    if problems:
        raise LoongError("Qwen3-VL vision side not expressible as a Hugging Face config: " + "; ".join(problems))


def hf_vision_config(enc_cfg: EncoderConfig, proj_cfg: ProjectorConfig, moe: bool = False) -> dict:
    """The HF ``vision_config`` dict (``Qwen3VLVisionConfig`` fields; ``moe``: model_type of Qwen3-VL-MoE's)."""
    check_hf_compatible(enc_cfg, proj_cfg)
    return {
        "model_type": "qwen3_vl_moe_vision" if moe else "qwen3_vl_vision",
        "depth": enc_cfg.depth,
        "hidden_size": enc_cfg.hidden_size,
        "hidden_act": enc_cfg.hidden_act,
        "intermediate_size": enc_cfg.intermediate_size,
        "num_heads": enc_cfg.num_heads,
        "in_channels": enc_cfg.in_channels,
        "patch_size": enc_cfg.patch_size,
        "spatial_merge_size": enc_cfg.spatial_merge_size,
        "temporal_patch_size": enc_cfg.temporal_patch_size,
        "out_hidden_size": proj_cfg.out_hidden_size,
        "num_position_embeddings": enc_cfg.num_position_embeddings,
        "deepstack_visual_indexes": [int(i) for i in enc_cfg.deepstack_visual_indexes],
        "initializer_range": enc_cfg.init_std,
        "rope_parameters": {"rope_type": "axial", "rope_theta": enc_cfg.rope_theta},
    }


__all__ = ["HF_NORM_EPS", "check_hf_compatible", "enc_cfg_from_hf", "hf_to_native", "hf_vision_config",
           "native_to_hf", "proj_cfg_from_hf", "rules"]
