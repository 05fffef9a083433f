"""SigLIP2's NaFlex vision transformer (encoder family ``siglip2``) with the LLaVA-style ``mlp`` projector family
(a LayerNorm-free two-layer GELU MLP per patch).

``build_encoder`` / ``build_projector`` make the modules; ``mapping`` holds the Hugging Face key mapping (the keys
of a ``Siglip2VisionModel``, i.e. under ``vision_model.`` of a ``Siglip2Model`` checkpoint; the pooling head is
dropped; the projector under LLaVA's ``multi_modal_projector.`` names) and the config conversions; ``vision`` the
modules, their analytic parameter counts and FLOPs.
"""

from __future__ import annotations

from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.siglip2.mapping import (
    HF_DROPPED_PREFIX,
    HF_ENCODER_PREFIX,
    HF_PROJECTOR_PREFIX,
    enc_cfg_from_hf,
    hf_projector_config,
    hf_to_native,
    hf_vision_config,
    native_to_hf,
    proj_cfg_from_hf,
)
from loong.vlm.models.siglip2.vision import (
    MLPProjector,
    Siglip2VisionEncoder,
    encoder_cost,
    encoder_flops,
    encoder_num_parameters,
    pack_patches,
    projector_flops_per_patch,
    projector_num_parameters,
    spatial_shapes,
)
from loong.vlm.models.vision.common import init_vision_weights


def build_encoder(enc_cfg: EncoderConfig) -> Siglip2VisionEncoder:
    """SigLIP2's vision transformer for ``enc_cfg`` (family ``siglip2``), weights ~ N(0, ``enc_cfg.init_std``)."""
    module = Siglip2VisionEncoder(enc_cfg)
    init_vision_weights(module, enc_cfg.init_std)
    return module


def build_projector(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> MLPProjector:
    """The LLaVA-style ``mlp`` projector over ``enc_cfg``'s patch features."""
    module = MLPProjector(proj_cfg, enc_cfg)
    init_vision_weights(module, proj_cfg.init_std)
    return module


__all__ = ["HF_DROPPED_PREFIX", "HF_ENCODER_PREFIX", "HF_PROJECTOR_PREFIX", "MLPProjector", "Siglip2VisionEncoder",
           "build_encoder", "build_projector", "enc_cfg_from_hf", "encoder_cost", "encoder_flops",
           "encoder_num_parameters", "hf_projector_config", "hf_to_native", "hf_vision_config", "native_to_hf",
           "pack_patches", "proj_cfg_from_hf", "projector_flops_per_patch", "projector_num_parameters",
           "spatial_shapes"]
