"""The schema of a VLM's vision side: the **encoder** (a vision transformer) and the **projector** that maps its
features into the foundation's hidden size. Each is a config group (``encoder=``, ``projector=``); the foundation
is a loong-llm :class:`~loong.llm.models.config.DenseModelConfig` (``foundation=``).

One dataclass per component holds the fields of every family; a family reads the fields it needs and
:meth:`EncoderConfig.validate` refuses values a family cannot take. Field names follow the Hugging Face vision
configs they map to (``depth``/``num_hidden_layers`` → ``depth``, ``num_heads``/``num_attention_heads`` →
``num_heads``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from loong.core.config.checks import Check, NonEmptyStr, NonNegativeInt, PositiveFloat, PositiveInt
from loong.core.errors import LoongError

#: encoder family -> what it is (HF class of the vision module)
ENCODER_FAMILIES: dict[str, str] = {
    "qwen2_5_vit": "Qwen2.5-VL's ViT: 2-D RoPE, window attention, full attention at fullatt_block_indexes "
                   "(Qwen2_5_VisionTransformerPretrainedModel)",
    "qwen3_vit": "Qwen3-VL's ViT: learned position embeddings interpolated to the grid, DeepStack features "
                 "(Qwen3VLVisionModel)",
    "intern_vit": "InternVL 3.5's InternViT (InternVLVisionModel)",
    "siglip2": "SigLIP2's NaFlex ViT (Siglip2VisionModel)",
}

#: projector family -> what it is
PROJECTOR_FAMILIES: dict[str, str] = {
    "qwen2_5_merger": "Qwen2.5-VL's patch merger: RMSNorm, spatial_merge_size^2 patches concatenated, 2-layer MLP",
    "qwen3_merger": "Qwen3-VL's patch merger (LayerNorm before or after the merge) and its DeepStack mergers",
    "internvl_mlp": "InternVL's pixel shuffle (downsample_ratio) + LayerNorm + 2-layer MLP",
    "mlp": "LayerNorm-free 2-layer GELU MLP on each patch (LLaVA-style; for SigLIP2 encoders)",
}


@dataclass
class ComponentParallel:
    """A component's own parallel layout (``encoder.parallel``): its tensor-parallel size."""

    tp: PositiveInt = 1


@dataclass
class EncoderConfig:
    """Shape of the vision transformer. ``family`` selects the modules and the HF mapping.

    Common: ``depth`` blocks of ``hidden_size`` with ``num_heads`` heads and an MLP of ``intermediate_size``
    (``hidden_act``), patches of ``patch_size`` (``temporal_patch_size`` frames for the Qwen ViTs, whose patch
    embedding is a linear layer on the flattened ``[C, T, P, P]`` patch: the same numbers as HF's Conv3d), norm
    epsilon ``norm_eps``.

    The Qwen ViTs' 2-D rotary embedding has base ``rope_theta``.

    Qwen2.5-VL: ``window_size`` (pixels) for the windowed blocks, ``fullatt_block_indexes`` the full-attention
    ones, ``tokens_per_second`` the M-RoPE temporal ids per second of video (HF ``vision_config``; used by the
    data side's position ids, not by the ViT). Qwen3-VL: ``num_position_embeddings`` learned positions (a square grid, bilinearly interpolated to each
    image), ``deepstack_visual_indexes`` the blocks whose outputs feed the DeepStack mergers. InternViT:
    ``image_size`` (the tile), ``layer_scale_init_value``, ``use_qk_norm``, ``norm_type``, ``use_mean_pooling``.
    SigLIP2: ``num_position_embeddings`` (a square grid resized to each image's patches).

    ``decoupled``: run the encoder data-parallel on every rank outside the foundation's pipeline (docs/vlm.md).
    """

    family: Literal["qwen2_5_vit", "qwen3_vit", "intern_vit", "siglip2"] = "qwen2_5_vit"
    preset: NonEmptyStr = "custom"
    depth: PositiveInt = 2
    hidden_size: PositiveInt = 32
    intermediate_size: PositiveInt = 64
    num_heads: PositiveInt = 2
    in_channels: PositiveInt = 3
    patch_size: PositiveInt = 14
    temporal_patch_size: PositiveInt = 2
    spatial_merge_size: PositiveInt = 2
    hidden_act: NonEmptyStr = "silu"
    norm_eps: PositiveFloat = 1e-6
    qkv_bias: bool = True
    window_size: PositiveInt = 112
    tokens_per_second: PositiveFloat = 2.0
    rope_theta: PositiveFloat = 10000.0
    fullatt_block_indexes: list = field(default_factory=list)
    num_position_embeddings: NonNegativeInt = 0
    deepstack_visual_indexes: list = field(default_factory=list)
    image_size: PositiveInt = 448
    layer_scale_init_value: float = 0.1
    use_qk_norm: bool = False
    norm_type: Literal["layer_norm", "rms_norm"] = "layer_norm"  # InternViT's HF norm_type
    use_mean_pooling: bool = True  # InternViT: HF's flag; True = no final LayerNorm after the blocks
    init_std: PositiveFloat = 0.02
    init_from: str | None = None
    recompute: bool = False
    decoupled: bool = False
    parallel: ComponentParallel = field(default_factory=ComponentParallel)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self, path: str) -> None:
        """Checks that need only this config (family-specific shapes)."""
        if self.hidden_size % self.num_heads:
            raise LoongError(f"{path}.hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}")
        for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            bad = [i for i in getattr(self, name) if not 0 <= int(i) < self.depth]
            if bad:
                raise LoongError(f"{path}.{name}: {bad} outside the encoder's blocks 0..{self.depth - 1}")


@dataclass
class ProjectorConfig:
    """Encoder features → foundation embeddings. ``out_hidden_size`` is the foundation's hidden size (the task
    checks it; presets interpolate ``${foundation.hidden_size}``). ``hidden_size`` is the MLP's inner width
    (0: the family's default, e.g. Qwen's ``encoder.hidden_size * spatial_merge_size**2``);
    ``downsample_ratio`` is InternVL's pixel-shuffle ratio."""

    family: Literal["qwen2_5_merger", "qwen3_merger", "internvl_mlp", "mlp"] = "qwen2_5_merger"
    out_hidden_size: PositiveInt = 64
    hidden_size: NonNegativeInt = 0
    hidden_act: NonEmptyStr = "gelu"
    downsample_ratio: Annotated[float, Check(gt=0, le=1)] = 0.5
    init_std: PositiveFloat = 0.02
