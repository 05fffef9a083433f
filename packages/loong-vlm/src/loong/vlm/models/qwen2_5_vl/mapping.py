"""Hugging Face mapping of Qwen2.5-VL's vision side, declared once.

HF keys are relative to ``model.visual.`` of ``Qwen2_5_VLForConditionalGeneration`` (transformers 5.x layout;
the published safetensors name them ``visual.*``, which transformers renames on load), i.e. the state dict of
``Qwen2_5_VisionTransformerPretrainedModel``. ``merger.*`` maps to ``projector.*``, the rest to ``encoder.*``:

=====================================  ================================================  ========================
HF (``model.visual.``)                 native                                            transform
=====================================  ================================================  ========================
``patch_embed.proj.weight``            ``encoder.patch_embed.weight``                    Conv3d ↔ Linear reshape
``blocks.{i}.norm{1,2}.weight``        ``encoder.blocks.{i}.norm{1,2}.weight``
``blocks.{i}.attn.qkv.{weight,bias}``  ``encoder.blocks.{i}.attn.qkv.*``                 ``[3,h,hd]`` ↔ ``[h,3,hd]``
``blocks.{i}.attn.proj.*``             ``encoder.blocks.{i}.attn.proj.*``
``blocks.{i}.mlp.{gate,up,down}_proj`` ``encoder.blocks.{i}.mlp.{gate,up,down}_proj.*``
``merger.ln_q.weight``                 ``projector.merger.norm.weight``
``merger.mlp.0.*`` / ``merger.mlp.2.*`` ``projector.merger.fc1.*`` / ``projector.merger.fc2.*``
=====================================  ================================================  ========================

The config side: :func:`enc_cfg_from_hf` / :func:`proj_cfg_from_hf` read an HF ``vision_config`` dict,
:func:`hf_vision_config` writes one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from loong.core.errors import LoongError
from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.vision.common import KeyRule, conv_to_linear, hf_value, map_state, qkv_hf_to_native

#: HF's norms in this ViT and merger are built with this epsilon (not read from the config)
HF_NORM_EPS = 1e-6


def rules(enc_cfg: EncoderConfig, proj_cfg: ProjectorConfig) -> list[KeyRule]:
    """Every tensor of the vision side, HF key ↔ native key."""
    c, t, p = enc_cfg.in_channels, enc_cfg.temporal_patch_size, enc_cfg.patch_size
    patch_to_native, patch_to_hf = conv_to_linear((enc_cfg.hidden_size, c, t, p, p))
    qkv_to_native, qkv_to_hf = qkv_hf_to_native(enc_cfg.num_heads)
    out = [KeyRule("patch_embed.proj.weight", "encoder.patch_embed.weight", patch_to_native, patch_to_hf)]
    for i in range(enc_cfg.depth):
        hf, nat = f"blocks.{i}.", f"encoder.blocks.{i}."
        out += [KeyRule(hf + "norm1.weight", nat + "norm1.weight"), KeyRule(hf + "norm2.weight", nat + "norm2.weight")]
        qkv = ("weight", "bias") if enc_cfg.qkv_bias else ("weight",)
        out += [KeyRule(f"{hf}attn.qkv.{s}", f"{nat}attn.qkv.{s}", qkv_to_native, qkv_to_hf) for s in qkv]
        out += [KeyRule(f"{hf}attn.proj.{s}", f"{nat}attn.proj.{s}") for s in ("weight", "bias")]
        out += [KeyRule(f"{hf}mlp.{m}.{s}", f"{nat}mlp.{m}.{s}")
                for m in ("gate_proj", "up_proj", "down_proj") for s in ("weight", "bias")]
    out.append(KeyRule("merger.ln_q.weight", "projector.merger.norm.weight"))
    out += [KeyRule(f"merger.mlp.{hf}.{s}", f"projector.merger.{nat}.{s}")
            for hf, nat in (("0", "fc1"), ("2", "fc2")) for s in ("weight", "bias")]
    return out


def hf_to_native(hf_state: Mapping[str, torch.Tensor], enc_cfg: EncoderConfig,
                 proj_cfg: ProjectorConfig) -> dict[str, torch.Tensor]:
    """HF ``model.visual.*`` tensors (prefix stripped) -> native ``encoder.*`` / ``projector.*`` tensors."""
    return map_state(hf_state, rules(enc_cfg, proj_cfg), to_native=True, where="qwen2_5_vl vision (HF -> Loong)")


def native_to_hf(native: Mapping[str, torch.Tensor], enc_cfg: EncoderConfig,
                 proj_cfg: ProjectorConfig) -> dict[str, torch.Tensor]:
    """Native ``encoder.*`` / ``projector.*`` tensors -> HF keys relative to ``model.visual.``."""
    return map_state(native, rules(enc_cfg, proj_cfg), to_native=False, where="qwen2_5_vl vision (Loong -> HF)")


def _rope_theta(hf: Mapping) -> float:
    rope = hf.get("rope_parameters") or {}
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def enc_cfg_from_hf(hf: Mapping) -> EncoderConfig:
    """``EncoderConfig`` (family ``qwen2_5_vit``) from an HF Qwen2.5-VL ``vision_config`` dict (transformers'
    names, and the published config.json's ``in_chans``)."""
    return EncoderConfig(
        family="qwen2_5_vit",
        depth=int(hf_value(hf, "depth", "num_hidden_layers")),
        hidden_size=int(hf_value(hf, "hidden_size", "embed_dim")),
        intermediate_size=int(hf_value(hf, "intermediate_size")),
        num_heads=int(hf_value(hf, "num_heads", "num_attention_heads")),
        in_channels=int(hf_value(hf, "in_channels", "in_chans", default=3)),
        patch_size=int(hf_value(hf, "patch_size", "spatial_patch_size")),
        temporal_patch_size=int(hf_value(hf, "temporal_patch_size", default=2)),
        spatial_merge_size=int(hf_value(hf, "spatial_merge_size", default=2)),
        hidden_act=str(hf_value(hf, "hidden_act", default="silu")),
        norm_eps=HF_NORM_EPS,
        qkv_bias=True,
        window_size=int(hf_value(hf, "window_size")),
        rope_theta=_rope_theta(hf),
        fullatt_block_indexes=[int(i) for i in hf_value(hf, "fullatt_block_indexes")],
        init_std=float(hf_value(hf, "initializer_range", default=0.02)),
    )


def proj_cfg_from_hf(hf: Mapping) -> ProjectorConfig:
    """``ProjectorConfig`` (family ``qwen2_5_merger``) from an HF Qwen2.5-VL ``vision_config`` dict."""
    return ProjectorConfig(family="qwen2_5_merger", out_hidden_size=int(hf_value(hf, "out_hidden_size")),
                           hidden_size=0, hidden_act="gelu",
                           init_std=float(hf_value(hf, "initializer_range", default=0.02)))


def check_hf_compatible(enc_cfg: EncoderConfig, proj_cfg: ProjectorConfig) -> None:
    """Refuse what HF's modules cannot express (they fix the norm epsilon, the qkv bias, the merger's shape and
    activation)."""
    problems = []
    if enc_cfg.norm_eps != HF_NORM_EPS:
        problems.append(f"encoder.norm_eps={enc_cfg.norm_eps} (HF uses {HF_NORM_EPS})")
    if not enc_cfg.qkv_bias:
        problems.append("encoder.qkv_bias=false (HF's qkv has a bias)")
    h = enc_cfg.hidden_size * enc_cfg.spatial_merge_size ** 2
    if proj_cfg.hidden_size not in (0, h):
        problems.append(f"projector.hidden_size={proj_cfg.hidden_size} (HF's merger is {h} wide)")
    if proj_cfg.hidden_act != "gelu":
        problems.append(f"projector.hidden_act={proj_cfg.hidden_act!r} (HF's merger uses gelu)")
    if problems:
        raise LoongError("Qwen2.5-VL vision side not expressible as a Hugging Face config: " + "; ".join(problems))


def hf_vision_config(enc_cfg: EncoderConfig, proj_cfg: ProjectorConfig) -> dict:
    """The HF ``vision_config`` dict (``Qwen2_5_VLVisionConfig`` fields) of this encoder + projector."""
    check_hf_compatible(enc_cfg, proj_cfg)
    return {
        "model_type": "qwen2_5_vl_vision",
        "depth": enc_cfg.depth,
        "hidden_size": enc_cfg.hidden_size,
        "hidden_act": enc_cfg.hidden_act,
        "intermediate_size": enc_cfg.intermediate_size,
        "num_heads": enc_cfg.num_heads,
        "in_channels": enc_cfg.in_channels,
        "patch_size": enc_cfg.patch_size,
        "spatial_merge_size": enc_cfg.spatial_merge_size,
        "temporal_patch_size": enc_cfg.temporal_patch_size,
        "window_size": enc_cfg.window_size,
        "out_hidden_size": proj_cfg.out_hidden_size,
        "fullatt_block_indexes": [int(i) for i in enc_cfg.fullatt_block_indexes],
        "initializer_range": enc_cfg.init_std,
        "rope_parameters": {"rope_type": "axial", "rope_theta": enc_cfg.rope_theta},
    }


__all__ = ["HF_NORM_EPS", "check_hf_compatible", "enc_cfg_from_hf", "hf_to_native", "hf_vision_config",
           "native_to_hf", "proj_cfg_from_hf", "rules"]
