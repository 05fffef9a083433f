"""The run schema of ``loong-vlm train``: the core run config with the VLM's three components and its data.

A VLM config composes three groups, each its own section: ``encoder`` (:class:`~loong.vlm.models.config.
EncoderConfig`), ``projector`` (:class:`~loong.vlm.models.config.ProjectorConfig`) and ``foundation`` (loong-llm's
:class:`~loong.llm.models.config.DenseModelConfig`, any LLM family). ``model`` holds what belongs to the assembly:
the VLM family (which HF class it maps to), the foundation's rotary layout (M-RoPE), freezing and initialisation.
``parallel`` is the foundation's layout (the megatron engine's); the encoder's is ``encoder.parallel``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from loong.core.config.checks import (
    Check,
    ExistingDir,
    NonEmptyStr,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)
from loong.core.config.schema import DataConfig, RunConfig
from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig
from loong.vlm.models.config import EncoderConfig, ProjectorConfig

#: components ``model.freeze`` may name
COMPONENTS = ("encoder", "projector", "foundation")


@dataclass
class LRMultipliers:
    """``model.lr_mult``: each component's learning rate as a multiple of ``train.lr`` (and of ``train.min_lr``)."""

    encoder: PositiveFloat = 1.0
    projector: PositiveFloat = 1.0
    foundation: PositiveFloat = 1.0


@dataclass
class VLMModelConfig:
    """The assembly of ``encoder`` + ``projector`` + ``foundation``.

    ``family``: the Hugging Face VLM it maps to (``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_vl_moe``, ``internvl``), or
    ``custom`` (any pairing, e.g. a DeepSeek-V3 foundation: trained and checkpointed natively, no HF export).
    ``mrope_section`` (three channel counts, temporal/height/width, summing to the foundation's head width / 2;
    null: 1-D RoPE) and ``mrope_interleaved`` (Qwen3-VL's layout) set the foundation's rotary embedding; a
    foundation without M-RoPE takes 1-D positions (``data.positions`` follows). ``freeze``: components whose
    weights do not train (no gradients, no optimiser state), e.g. ``[encoder]`` or ``[encoder, foundation]``
    (projector-only alignment). ``lr_mult``: per-component learning-rate multipliers (default 1.0 each), e.g.
    ``model.lr_mult.encoder=0.1``: the component's peak and minimum learning rates are ``train.lr`` /
    ``train.min_lr`` times it, on the same schedule. ``init_from_hf``: a Hugging Face folder of ``family`` whose weights (all
    three components) start a fresh run; its config sets the shapes.
    """

    family: Literal["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "internvl", "custom"] = "qwen2_5_vl"
    preset: NonEmptyStr = "custom"
    mrope_section: list | None = None
    mrope_interleaved: bool = False
    freeze: list = field(default_factory=list)
    lr_mult: LRMultipliers = field(default_factory=lambda: LRMultipliers())
    init_from_hf: ExistingDir | None = None

    def validate(self, path: str) -> None:
        bad = [c for c in self.freeze if c not in COMPONENTS]
        if bad:
            raise LoongError(f"{path}.freeze: {bad} are not components (choose from {', '.join(COMPONENTS)})")
        if len(set(self.freeze)) == len(COMPONENTS):
            raise LoongError(f"{path}.freeze={self.freeze} freezes every component: nothing would train")


@dataclass
class VLMDataConfig(DataConfig):
    """Conversations with images and videos (``path``: a JSONL file; null: the synthetic shapes set).

    ``processor``: a local Hugging Face processor folder (null: the tiny processor built offline to match the
    encoder); ``min_pixels``/``max_pixels`` (and ``video_`` ones) bound a Qwen image's (frame's) resized area
    (null: the folder's); ``max_tiles`` caps InternVL's tiles; ``fps``/``max_frames`` sample videos;
    ``positions``: ``auto`` (the family's M-RoPE or 1-D), ``mrope`` or ``1d``; ``packing``: several conversations
    a sequence (per-sample attention, positions restarting); ``overlong``: ``truncate`` (never inside an image)
    or ``drop``; ``on_error``: ``raise`` on a broken line or medium, or ``skip`` and count it; ``num_workers``:
    DataLoader processes decoding media; ``synthetic_size`` / ``synthetic_seed``: the default set's size and seed.
    """

    chat_format: Literal["auto", "messages", "sharegpt", "alpaca"] = "auto"
    chat_template: NonEmptyStr = "auto"
    processor: ExistingDir | None = None
    media_root: ExistingDir | None = None
    min_pixels: PositiveInt | None = None
    max_pixels: PositiveInt | None = None
    video_min_pixels: PositiveInt | None = None
    video_max_pixels: PositiveInt | None = None
    max_tiles: PositiveInt | None = None
    fps: PositiveFloat = 2.0
    max_frames: PositiveInt = 32
    positions: Literal["auto", "mrope", "1d"] = "auto"
    packing: bool = True
    overlong: Literal["truncate", "drop"] = "truncate"
    on_error: Literal["raise", "skip"] = "raise"
    num_workers: NonNegativeInt = 0
    synthetic_size: Annotated[int, Check(ge=2)] = 256
    synthetic_seed: NonNegativeInt = 0

    def validate(self, path: str) -> None:
        for low, high in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
            lo, hi = getattr(self, low), getattr(self, high)
            if lo is not None and hi is not None and lo > hi:
                raise LoongError(f"{path}.{low}={lo} is larger than {path}.{high}={hi}")


@dataclass
class VLMRunConfig(RunConfig):
    """``loong-vlm train`` config."""

    task: str = "vlm.sft"
    model: VLMModelConfig = field(default_factory=VLMModelConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    foundation: DenseModelConfig = field(default_factory=DenseModelConfig)
    data: VLMDataConfig = field(default_factory=VLMDataConfig)


__all__ = ["COMPONENTS", "LRMultipliers", "VLMDataConfig", "VLMModelConfig", "VLMRunConfig"]
