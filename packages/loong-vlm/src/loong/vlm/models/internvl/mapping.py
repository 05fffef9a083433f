"""Hugging Face mapping of InternVL 3.5's vision side, declared once: state-dict keys and configs.

HF keys are relative to ``model.`` of ``InternVLForConditionalGeneration`` (transformers 5.x layout): the vision
tower under ``vision_tower.`` (:data:`HF_ENCODER_PREFIX`, an ``InternVLVisionModel``) and the projector under
``multi_modal_projector.`` (:data:`HF_PROJECTOR_PREFIX`); ``language_model.*`` is the foundation's, not here.

Below, ``vt.`` is ``vision_tower.``, ``L{i}.`` is ``vision_tower.encoder.layer.{i}.`` and ``B{i}.`` is
``encoder.blocks.{i}.``:

================================================  ===============================  ============================
HF (``model.``)                                   native                           transform
================================================  ===============================  ============================
``vt.embeddings.cls_token``                       ``encoder.cls_token``            ``[1, 1, d]`` ↔ ``[d]``
``vt.embeddings.position_embeddings``             ``encoder.pos_embed``            ``[1, N+1, d]`` ↔ ``[N+1, d]``
``vt.embeddings.patch_embeddings.projection.*``   ``encoder.patch_embed.*``        Conv2d ↔ Linear reshape
``L{i}.attention.{q,k,v}_proj.*``                 ``B{i}.attn.qkv.*``              cat; ``[3,h,hd]`` ↔ ``[h,3,hd]``
``L{i}.attention.projection_layer.*``             ``B{i}.attn.proj.*``
``L{i}.attention.{q,k}_norm.weight``              ``B{i}.attn.{q,k}_norm.weight``  (``use_qk_norm`` only)
``L{i}.layernorm_{before,after}.*``               ``B{i}.norm{1,2}.*``
``L{i}.lambda_{1,2}``                             ``B{i}.ls{1,2}``
``L{i}.mlp.fc{1,2}.*``                            ``B{i}.mlp.fc{1,2}.*``
``vt.layernorm.*``                                ``encoder.norm.*``               (``use_mean_pooling=false``)
``multi_modal_projector.layer_norm.*``            ``projector.norm.*``
``multi_modal_projector.linear_{1,2}.*``          ``projector.fc{1,2}.*``
================================================  ===============================  ============================

Every transform is exact (reshape, cat/split, permutation): HF → Loong → HF is bit-exact.

The config side: :func:`enc_cfg_from_hf` / :func:`hf_vision_config` read/write ``InternVLConfig.vision_config``;
:func:`proj_cfg_from_hf` reads the composite ``InternVLConfig`` dict (its projector fields sit at the top level,
its output width is ``text_config.hidden_size``) and :func:`hf_projector_config` writes those top-level fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from loong.core.config.schema import check_config
from loong.core.errors import LoongError
from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.internvl.vision import check_encoder, check_projector, tokens_per_tile
from loong.vlm.models.vision.common import KeyRule, conv_to_linear, hf_value, map_state, qkv_hf_to_native

HF_ENCODER_PREFIX = "vision_tower."
HF_PROJECTOR_PREFIX = "multi_modal_projector."

_WB = ("weight", "bias")


def _drop_batch(t: torch.Tensor) -> torch.Tensor:
    """HF's leading singleton dims off: ``cls_token [1, 1, d] -> [d]``, ``position_embeddings [1, n, d] -> [n, d]``."""
    return t.reshape(t.shape[2:] if t.shape[1] == 1 else t.shape[1:])


def _cls_to_hf(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, 1, -1)


def _pos_to_hf(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, *t.shape)


def _rules(enc_cfg: EncoderConfig, proj_cfg: ProjectorConfig | None) -> tuple[list[KeyRule], dict[str, list[str]]]:
    """``(rules, fused)``: every tensor HF key ↔ native key, where a fused ``qkv`` appears under a *virtual* HF key
    ``...attention.qkv.*`` that ``fused`` maps to its three real HF keys (q, k, v, concatenated in that order)."""
    d, c, p, hf = enc_cfg.hidden_size, enc_cfg.in_channels, enc_cfg.patch_size, HF_ENCODER_PREFIX
    patch_to_native, patch_to_hf = conv_to_linear((d, c, p, p))
    qkv_to_native, qkv_to_hf = qkv_hf_to_native(enc_cfg.num_heads)
    rules = [KeyRule(f"{hf}embeddings.cls_token", "encoder.cls_token", _drop_batch, _cls_to_hf),
             KeyRule(f"{hf}embeddings.position_embeddings", "encoder.pos_embed", _drop_batch, _pos_to_hf),
             KeyRule(f"{hf}embeddings.patch_embeddings.projection.weight", "encoder.patch_embed.weight",
                     patch_to_native, patch_to_hf),
             KeyRule(f"{hf}embeddings.patch_embeddings.projection.bias", "encoder.patch_embed.bias")]
    fused: dict[str, list[str]] = {}
    norm_params = ("weight",) if enc_cfg.norm_type == "rms_norm" else _WB
    for i in range(enc_cfg.depth):
        h, n = f"{hf}encoder.layer.{i}.", f"encoder.blocks.{i}."
        rules += [KeyRule(f"{h}lambda_{j}", f"{n}ls{j}") for j in (1, 2)]
        rules += [KeyRule(f"{h}layernorm_{a}.{s}", f"{n}norm{j}.{s}")
                  for j, a in ((1, "before"), (2, "after")) for s in norm_params]
        for s in _WB if enc_cfg.qkv_bias else ("weight",):
            fused[f"{h}attention.qkv.{s}"] = [f"{h}attention.{x}_proj.{s}" for x in "qkv"]
            rules.append(KeyRule(f"{h}attention.qkv.{s}", f"{n}attn.qkv.{s}", qkv_to_native, qkv_to_hf))
        rules += [KeyRule(f"{h}attention.projection_layer.{s}", f"{n}attn.proj.{s}") for s in _WB]
        if enc_cfg.use_qk_norm:
            rules += [KeyRule(f"{h}attention.{x}_norm.weight", f"{n}attn.{x}_norm.weight") for x in "qk"]
        rules += [KeyRule(f"{h}mlp.{fc}.{s}", f"{n}mlp.{fc}.{s}") for fc in ("fc1", "fc2") for s in _WB]
    if not enc_cfg.use_mean_pooling:
        rules += [KeyRule(f"{hf}layernorm.{s}", f"encoder.norm.{s}") for s in _WB]
    if proj_cfg is not None:
        pairs = (("layer_norm", "norm"), ("linear_1", "fc1"), ("linear_2", "fc2"))
        rules += [KeyRule(f"{HF_PROJECTOR_PREFIX}{a}.{s}", f"projector.{b}.{s}") for a, b in pairs for s in _WB]
    return rules, fused


def key_rules(enc_cfg: EncoderConfig, proj_cfg: ProjectorConfig | None
              ) -> tuple[list[KeyRule], dict[str, list[str]]]:
    """``(rules, fused)`` of :func:`_rules`, for a converter that maps one tensor (or fused qkv group) at a time."""
    return _rules(enc_cfg, proj_cfg)


def hf_to_native(hf_state: Mapping[str, torch.Tensor], enc_cfg: EncoderConfig,
                 proj_cfg: ProjectorConfig | None) -> dict[str, torch.Tensor]:
    """HF vision-side tensors (keys relative to ``model.``; ``proj_cfg=None``: the vision tower alone) -> native
    ``encoder.*`` / ``projector.*``. The keys must be exactly those of the config: a missing or an unexpected
    one is a :class:`LoongError` naming it."""
    rules, fused = _rules(enc_cfg, proj_cfg)
    real = {r.hf for r in rules if r.hf not in fused} | {k for parts in fused.values() for k in parts}
    missing, unexpected = sorted(real - set(hf_state)), sorted(set(hf_state) - real)
    if missing or unexpected:
        raise LoongError(f"internvl vision (HF -> Loong): state dict does not match the config: missing "
                         f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    state = {k: v for k, v in hf_state.items() if k in real}
    for virtual, parts in fused.items():
        state[virtual] = torch.cat([state.pop(k) for k in parts])
    return map_state(state, rules, to_native=True, where="internvl vision (HF -> Loong)")


def native_to_hf(native: Mapping[str, torch.Tensor], enc_cfg: EncoderConfig,
                 proj_cfg: ProjectorConfig | None) -> dict[str, torch.Tensor]:
    """Native ``encoder.*`` / ``projector.*`` tensors -> HF keys relative to ``model.`` (the inverse of
    :func:`hf_to_native`)."""
    rules, fused = _rules(enc_cfg, proj_cfg)
    out = map_state(native, rules, to_native=False, where="internvl vision (Loong -> HF)")
    for virtual, parts in fused.items():
        # clones: chunks would share one storage, which safetensors refuses to save
        for k, part in zip(parts, out.pop(virtual).chunk(3), strict=True):
            out[k] = part.clone()
    return out


# ------------------------------------------------------------------------------------------------ configs

def _square(value: Any, key: str) -> int:
    """An HF size given as an int or ``[h, w]``; InternVL's tiles and patches are square."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise LoongError(f"vision_config.{key}={list(value)}: InternViT takes square sizes only")
        return int(value[0])
    return int(value)


def enc_cfg_from_hf(hf: Mapping) -> EncoderConfig:
    """``EncoderConfig`` (family ``intern_vit``) from an HF ``InternVLVisionConfig`` dict (missing keys take HF's
    defaults). Dropout probabilities are ignored (the modules have none); a mask token or no absolute positions
    are refused (no InternVL checkpoint has either on its VLM path)."""
    if hf.get("use_mask_token", False):
        raise LoongError("vision_config.use_mask_token=true: the masked-image-modelling token is not part of "
                         "InternVL's vision path; export the checkpoint without it")
    if not hf.get("use_absolute_position_embeddings", True):
        raise LoongError("vision_config.use_absolute_position_embeddings=false: InternViT here always has "
                         "learned absolute positions (every InternVL checkpoint does)")
    cfg = EncoderConfig(
        family="intern_vit",
        depth=int(hf_value(hf, "num_hidden_layers", default=24)),
        hidden_size=int(hf_value(hf, "hidden_size", default=1024)),
        intermediate_size=int(hf_value(hf, "intermediate_size", default=4096)),
        num_heads=int(hf_value(hf, "num_attention_heads", default=16)),
        in_channels=int(hf_value(hf, "num_channels", default=3)),
        patch_size=_square(hf_value(hf, "patch_size", default=14), "patch_size"),
        image_size=_square(hf_value(hf, "image_size", default=448), "image_size"),
        hidden_act=str(hf_value(hf, "hidden_act", default="gelu")),
        norm_eps=float(hf_value(hf, "layer_norm_eps", default=1e-6)),
        qkv_bias=bool(hf_value(hf, "attention_bias", default=False)),
        layer_scale_init_value=float(hf_value(hf, "layer_scale_init_value", default=0.1)),
        use_qk_norm=bool(hf_value(hf, "use_qk_norm", default=False)),
        norm_type=str(hf_value(hf, "norm_type", default="layer_norm")),
        use_mean_pooling=bool(hf_value(hf, "use_mean_pooling", default=True)),
        init_std=float(hf_value(hf, "initializer_range", default=0.02)),
    )
    check_encoder(cfg)
    return cfg


def hf_vision_config(enc_cfg: EncoderConfig, proj_cfg: ProjectorConfig | None = None) -> dict:
    """The HF ``InternVLVisionConfig`` dict of ``enc_cfg`` (``InternVLConfig.vision_config``). ``proj_cfg`` is
    not needed: its fields live at the composite's top level (:func:`hf_projector_config`)."""
    check_encoder(enc_cfg)
    c = enc_cfg
    return {
        "model_type": "internvl_vision",
        "num_hidden_layers": c.depth,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_channels": c.in_channels,
        "patch_size": [c.patch_size, c.patch_size],
        "image_size": [c.image_size, c.image_size],
        "hidden_act": c.hidden_act,
        "layer_norm_eps": c.norm_eps,
        "attention_bias": c.qkv_bias,
        "layer_scale_init_value": c.layer_scale_init_value,
        "use_qk_norm": c.use_qk_norm,
        "norm_type": c.norm_type,
        "use_mean_pooling": c.use_mean_pooling,
        "use_mask_token": False,
        "use_absolute_position_embeddings": True,
        "initializer_range": c.init_std,
    }


def proj_cfg_from_hf(hf: Mapping) -> ProjectorConfig:
    """``ProjectorConfig`` (family ``internvl_mlp``) from an HF ``InternVLConfig`` dict (the composite). Only the
    last layer's features without CLS are projected, as in every InternVL 3.5 checkpoint
    (``vision_feature_layer=-1``, ``vision_feature_select_strategy="default"``); other values are refused."""
    layer = hf.get("vision_feature_layer", -1)
    if layer != -1:
        raise LoongError(f"vision_feature_layer={layer}: InternVL here projects the last layer's features (-1) only")
    strategy = hf.get("vision_feature_select_strategy", "default")
    if strategy != "default":
        raise LoongError(f"vision_feature_select_strategy={strategy!r}: InternVL here drops the CLS token "
                         "('default') only")
    text = hf.get("text_config") or {}
    cfg = ProjectorConfig(family="internvl_mlp",
                          out_hidden_size=int(hf_value(text, "hidden_size", where="text_config")),
                          hidden_act=str(hf_value(hf, "projector_hidden_act", default="gelu", where="config")),
                          downsample_ratio=float(hf_value(hf, "downsample_ratio", default=0.5, where="config")))
    check_config(cfg, "projector")
    return cfg


def hf_projector_config(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> dict:
    """The composite ``InternVLConfig``'s projector fields of ``proj_cfg``, with ``image_seq_length`` (tokens per
    tile); the caller adds ``vision_config`` and the ``text_config`` (whose ``hidden_size`` is
    ``out_hidden_size``)."""
    check_projector(proj_cfg, enc_cfg)
    return {
        "downsample_ratio": proj_cfg.downsample_ratio,
        "projector_hidden_act": proj_cfg.hidden_act,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
        "image_seq_length": tokens_per_tile(enc_cfg, proj_cfg),
    }


__all__ = ["HF_ENCODER_PREFIX", "HF_PROJECTOR_PREFIX", "enc_cfg_from_hf", "hf_projector_config", "hf_to_native",
           "hf_vision_config", "key_rules", "native_to_hf", "proj_cfg_from_hf"]
