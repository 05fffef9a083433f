"""Qwen3-VL's vision side, dense and MoE alike (encoder family ``qwen3_vit``, projector family ``qwen3_merger``).

``build_encoder`` / ``build_projector`` make the modules (initialised N(0, ``init_std``)); ``mapping`` holds the
Hugging Face key mapping (keys under ``model.visual.`` of ``Qwen3VLForConditionalGeneration`` and
``Qwen3VLMoeForConditionalGeneration``) and the ``vision_config`` conversions; ``vision`` the modules, their
analytic parameter counts and FLOPs.
"""

from __future__ import annotations

from torch import nn

from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.qwen3_vl.mapping import (
    enc_cfg_from_hf,
    hf_to_native,
    hf_vision_config,
    native_to_hf,
    proj_cfg_from_hf,
)
from loong.vlm.models.qwen3_vl.vision import (
    Qwen3Projector,
    Qwen3VisionEncoder,
    encoder_cost,
    encoder_flops,
    encoder_num_parameters,
    projector_flops_per_patch,
    projector_num_parameters,
)
from loong.vlm.models.vision.common import init_vision_weights


def build_encoder(enc_cfg: EncoderConfig) -> nn.Module:
    """Qwen3-VL's ViT for ``enc_cfg`` (family ``qwen3_vit``), weights ~ N(0, ``enc_cfg.init_std``)."""
    module = Qwen3VisionEncoder(enc_cfg)
    init_vision_weights(module, enc_cfg.init_std)
    return module


def build_projector(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> nn.Module:
    """Qwen3-VL's patch merger and DeepStack mergers (family ``qwen3_merger``) over ``enc_cfg``'s features."""
    module = Qwen3Projector(proj_cfg, enc_cfg)
    init_vision_weights(module, proj_cfg.init_std)
    return module


__all__ = ["Qwen3Projector", "Qwen3VisionEncoder", "build_encoder", "build_projector", "enc_cfg_from_hf",
           "encoder_cost", "encoder_flops", "encoder_num_parameters", "hf_to_native", "hf_vision_config",
           "native_to_hf", "proj_cfg_from_hf", "projector_flops_per_patch", "projector_num_parameters"]
