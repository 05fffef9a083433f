"""InternVL 3.5's vision side (encoder family ``intern_vit``, projector family ``internvl_mlp``).

``build_encoder`` / ``build_projector`` make the modules; ``mapping`` holds the Hugging Face key mapping (keys
under ``model.`` of ``InternVLForConditionalGeneration``: ``vision_tower.*`` and ``multi_modal_projector.*``)
and the config conversions (``vision_config`` for the encoder, the composite's top-level fields for the
projector); ``vision`` the modules, their analytic parameter counts and FLOPs.
"""

from __future__ import annotations

from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.internvl.mapping import (
    HF_ENCODER_PREFIX,
    HF_PROJECTOR_PREFIX,
    enc_cfg_from_hf,
    hf_projector_config,
    hf_to_native,
    hf_vision_config,
    native_to_hf,
    proj_cfg_from_hf,
)
from loong.vlm.models.internvl.vision import (
    InternVisionEncoder,
    InternVLProjector,
    encoder_cost,
    encoder_flops,
    encoder_num_parameters,
    projector_flops_per_patch,
    projector_num_parameters,
    tokens_per_tile,
)
from loong.vlm.models.vision.common import init_vision_weights


def build_encoder(enc_cfg: EncoderConfig) -> InternVisionEncoder:
    """InternViT for ``enc_cfg`` (family ``intern_vit``): linear weights and positions ~ N(0, ``init_std``), CLS 0,
    layer scales at ``layer_scale_init_value``."""
    module = InternVisionEncoder(enc_cfg)
    module.reset_parameters(enc_cfg.init_std, enc_cfg.layer_scale_init_value)
    return module


def build_projector(proj_cfg: ProjectorConfig, enc_cfg: EncoderConfig) -> InternVLProjector:
    """InternVL's pixel-shuffle MLP projector (family ``internvl_mlp``) over ``enc_cfg``'s tiles."""
    module = InternVLProjector(proj_cfg, enc_cfg)
    init_vision_weights(module, proj_cfg.init_std)
    return module


__all__ = ["HF_ENCODER_PREFIX", "HF_PROJECTOR_PREFIX", "InternVLProjector", "InternVisionEncoder", "build_encoder",
           "build_projector", "enc_cfg_from_hf", "encoder_cost", "encoder_flops", "encoder_num_parameters",
           "hf_projector_config", "hf_to_native", "hf_vision_config", "native_to_hf", "proj_cfg_from_hf",
           "projector_flops_per_patch", "projector_num_parameters", "tokens_per_tile"]
