"""SigLIP2's vision-side Hugging Face key mapping, declared once.

Encoder keys are those of a transformers 5.x ``Siglip2VisionModel`` (:data:`HF_ENCODER_PREFIX` is empty): the
keys under ``vision_model.`` of a ``Siglip2Model`` checkpoint, or under ``vision_tower.`` of a LLaVA-style
composite. The ``mlp`` projector takes LLaVA's names under ``multi_modal_projector.``
(:data:`HF_PROJECTOR_PREFIX`: ``linear_1``, ``linear_2`` of ``LlavaMultiModalProjector``, the same two-layer
MLP); transformers has no model of this exact pairing, so these names are a convention, not an HF checkpoint
format. Native keys are ``encoder.*`` and ``projector.*``.

======================================================  ===========================================  ===================
HF                                                      native                                       transform
======================================================  ===========================================  ===================
``embeddings.patch_embedding.*``                        ``encoder.patch_embed.*``
``embeddings.position_embedding.weight``                ``encoder.pos_embed.weight``
``encoder.layers.{i}.layer_norm{1,2}.*``                ``encoder.blocks.{i}.norm{1,2}.*``
``encoder.layers.{i}.self_attn.{q,k,v}_proj.*``         ``encoder.blocks.{i}.attn.qkv.*``            cat; per-head rows
``encoder.layers.{i}.self_attn.out_proj.*``             ``encoder.blocks.{i}.attn.proj.*``
``encoder.layers.{i}.mlp.fc{1,2}.*``                    ``encoder.blocks.{i}.mlp.fc{1,2}.*``
``post_layernorm.*``                                    ``encoder.norm.*``
``multi_modal_projector.linear_{1,2}.*``                ``projector.fc{1,2}.*``
======================================================  ===========================================  ===================

The attention-pooling head (``head.*``) is not part of a VLM's vision path: :func:`hf_to_native` drops it and
:func:`native_to_hf` writes none (export with ``vision_use_head=false``). Every transform is exact: HF → Loong →
HF is bit-exact on head-less state.

The config side: :func:`enc_cfg_from_hf` / :func:`hf_vision_config` read/write a ``Siglip2VisionConfig`` dict;
:func:`proj_cfg_from_hf` / :func:`hf_projector_config` LLaVA's projector fields (``projector_hidden_act``,
``text_config.hidden_size``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from loong.core.errors import LoongError
from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.siglip2.vision import check_encoder, check_projector
from loong.vlm.models.vision.common import KeyRule, hf_value, map_state, qkv_hf_to_native

HF_ENCODER_PREFIX = ""
HF_PROJECTOR_PREFIX = "multi_modal_projector."
#: HF keys left out on import: the attention-pooling head
HF_DROPPED_PREFIX = "head."

_WB = ("weight", "bias")


def _rules(enc_cfg: EncoderConfig, proj_cfg: ProjectorConfig | None) -> tuple[list[KeyRule], dict[str, list[str]]]:
    """``(rules, fused)``: every tensor HF key ↔ native key, where a fused ``qkv`` appears under a *virtual* HF key
    ``...self_attn.qkv.*`` that ``fused`` maps to its three real HF keys (q, k, v, concatenated in that order)."""
    hf = HF_ENCODER_PREFIX
    qkv_to_native, qkv_to_hf = qkv_hf_to_native(enc_cfg.num_heads)
    rules = [KeyRule(f"{hf}embeddings.patch_embedding.{s}", f"encoder.patch_embed.{s}") for s in _WB]
    rules.append(KeyRule(f"{hf}embeddings.position_embedding.weight", "encoder.pos_embed.weight"))
    fused: dict[str, list[str]] = {}
    for i in range(enc_cfg.depth):
        h, n = f"{hf}encoder.layers.{i}.", f"encoder.blocks.{i}."
        rules += [KeyRule(f"{h}layer_norm{j}.{s}", f"{n}norm{j}.{s}") for j in (1, 2) for s in _WB]
        for s in _WB:
            fused[f"{h}self_attn.qkv.{s}"] = [f"{h}self_attn.{x}_proj.{s}" for x in "qkv"]
            rules.append(KeyRule(f"{h}self_attn.qkv.{s}", f"{n}attn.qkv.{s}", qkv_to_native, qkv_to_hf))
        rules += [KeyRule(f"{h}self_attn.out_proj.{s}", f"{n}attn.proj.{s}") for s in _WB]
        rules += [KeyRule(f"{h}mlp.{fc}.{s}", f"{n}mlp.{fc}.{s}") for fc in ("fc1", "fc2") for s in _WB]
    rules += [KeyRule(f"{hf}post_layernorm.{s}", f"encoder.norm.{s}") for s in _WB]
    if proj_cfg is not None:
        rules += [KeyRule(f"{HF_PROJECTOR_PREFIX}linear_{j}.{s}", f"projector.fc{j}.{s}") for j in (1, 2) for s in _WB]
    return rules, fused


def hf_to_native(hf_state: Mapping[str, torch.Tensor], enc_cfg: EncoderConfig,
                 proj_cfg: ProjectorConfig | None) -> dict[str, torch.Tensor]:
    """HF tensors (``Siglip2VisionModel`` keys, plus ``multi_modal_projector.*`` unless ``proj_cfg`` is None) ->
    native ``encoder.*`` / ``projector.*``. ``head.*`` is dropped; any other missing or unexpected key is a
    :class:`LoongError` naming it."""
    rules, fused = _rules(enc_cfg, proj_cfg)
    kept = {k: v for k, v in hf_state.items() if not k.startswith(HF_ENCODER_PREFIX + HF_DROPPED_PREFIX)}
    real = {r.hf for r in rules if r.hf not in fused} | {k for parts in fused.values() for k in parts}
    missing, unexpected = sorted(real - set(kept)), sorted(set(kept) - real)
    if missing or unexpected:
        raise LoongError(f"siglip2 vision (HF -> Loong): state dict does not match the config: missing "
                         f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    for virtual, parts in fused.items():
        kept[virtual] = torch.cat([kept.pop(k) for k in parts])
    return map_state(kept, rules, to_native=True, where="siglip2 vision (HF -> Loong)")


def native_to_hf(native: Mapping[str, torch.Tensor], enc_cfg: EncoderConfig,
                 proj_cfg: ProjectorConfig | None) -> dict[str, torch.Tensor]:
    """Native ``encoder.*`` / ``projector.*`` tensors -> HF keys (the inverse of :func:`hf_to_native` on head-less
    state)."""
    rules, fused = _rules(enc_cfg, proj_cfg)
    out = map_state(native, rules, to_native=False, where="siglip2 vision (Loong -> HF)")
    for virtual, parts in fused.items():
        # clones: chunks would share one storage, which safetensors refuses to save
        for k, part in zip(parts, out.pop(virtual).chunk(3), strict=True):
            out[k] = part.clone()
    return out


# ------------------------------------------------------------------------------------------------ configs

def enc_cfg_from_hf(hf: Mapping) -> EncoderConfig:
    """``EncoderConfig`` (family ``siglip2``) from an HF ``Siglip2VisionConfig`` dict (missing keys take HF's
    defaults: the base-patch16-naflex shape). ``vision_use_head`` and the attention dropout are ignored (no head,
    no dropout here)."""
    patch: Any = hf_value(hf, "patch_size", default=16)
    if isinstance(patch, (list, tuple)):
        if len(patch) != 2 or patch[0] != patch[1]:
            raise LoongError(f"vision_config.patch_size={list(patch)}: SigLIP2 patches are square")
        patch = patch[0]
    cfg = EncoderConfig(
        family="siglip2",
        depth=int(hf_value(hf, "num_hidden_layers", default=12)),
        hidden_size=int(hf_value(hf, "hidden_size", default=768)),
        intermediate_size=int(hf_value(hf, "intermediate_size", default=3072)),
        num_heads=int(hf_value(hf, "num_attention_heads", default=12)),
        in_channels=int(hf_value(hf, "num_channels", default=3)),
        patch_size=int(patch),
        hidden_act=str(hf_value(hf, "hidden_act", default="gelu_pytorch_tanh")),
        norm_eps=float(hf_value(hf, "layer_norm_eps", default=1e-6)),
        qkv_bias=True,
        num_position_embeddings=int(hf_value(hf, "num_patches", default=256)),
    )
    check_encoder(cfg)
    return cfg


def hf_vision_config(enc_cfg: EncoderConfig, proj_cfg: ProjectorConfig | None = None) -> dict:
    """The HF ``Siglip2VisionConfig`` dict of ``enc_cfg``, without the pooling head. ``proj_cfg`` is not needed
    (its fields: :func:`hf_projector_config`)."""
    check_encoder(enc_cfg)
    c = enc_cfg
    return {
        "model_type": "siglip2_vision_model",
        "num_hidden_layers": c.depth,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_channels": c.in_channels,
        "patch_size": c.patch_size,
        "hidden_act": c.hidden_act,
        "layer_norm_eps": c.norm_eps,
        "num_patches": c.num_position_embeddings,
        "vision_use_head": False,
    }


def proj_cfg_from_hf(hf: Mapping) -> ProjectorConfig:
    """The ``mlp`` projector from a LLaVA-style composite config dict: ``text_config.hidden_size`` (output and
    inner width) and ``projector_hidden_act`` (default gelu); nothing else is read."""
    text = hf.get("text_config") or {}
    cfg = ProjectorConfig(family="mlp", out_hidden_size=int(hf_value(text, "hidden_size", where="text_config")),
                          hidden_act=str(hf_value(hf, "projector_hidden_act", default="gelu", where="config")))
    check_projector(cfg)
    return cfg


def hf_projector_config(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> dict:
    """The composite config's projector fields (LLaVA's names); the caller adds ``text_config``. LLaVA's form has
    the inner width equal to the output width, so another ``hidden_size`` is refused."""
    check_projector(proj_cfg)
    if proj_cfg.hidden_size not in (0, proj_cfg.out_hidden_size):
        raise LoongError(f"projector.hidden_size={proj_cfg.hidden_size}: LLaVA's projector form has its inner width "
                         f"equal to out_hidden_size={proj_cfg.out_hidden_size}; no HF config can hold another")
    return {"projector_hidden_act": proj_cfg.hidden_act}


__all__ = ["HF_DROPPED_PREFIX", "HF_ENCODER_PREFIX", "HF_PROJECTOR_PREFIX", "enc_cfg_from_hf",
           "hf_projector_config", "hf_to_native", "hf_vision_config", "native_to_hf", "proj_cfg_from_hf"]
