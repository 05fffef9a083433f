"""The run schema of ``loong-diffusion train``: the core run config with typed ``model``, ``data`` and ``train``.

Flow-matching keys live in ``train`` (``train.timestep_sampling``, ``train.timestep_shift``, ...), as the issue
names them: they shape the optimisation target, not the data on disk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from loong.core.config.schema import RunConfig, TrainConfig
from loong.core.errors import LoongError
from loong.diffusion.models.wan.config import PRESETS, WanConfig, wan_preset

#: WanConfig fields a run may override on top of its preset (every field of the dataclass)
WAN_FIELDS = tuple(f.name for f in dataclasses.fields(WanConfig))


@dataclass
class WanModelConfig:
    """The Wan transformer of a run: ``preset`` (a :data:`~loong.diffusion.models.wan.config.PRESETS` name), then
    any :class:`WanConfig` field overriding it (``None``: the preset's value).

    ``recompute``: the fsdp engine's activation recomputation (``selective``: each block's MLP). ``init_from_diffusers``:
    a diffusers ``WanTransformer3DModel`` folder whose weights start a fresh run (its config must equal this one).
    """

    preset: str = "tiny"
    num_heads: int | None = None
    head_dim: int | None = None
    ffn_dim: int | None = None
    num_layers: int | None = None
    in_channels: int | None = None
    out_channels: int | None = None
    text_dim: int | None = None
    freq_dim: int | None = None
    patch_size: list[int] | None = None
    cross_attn_norm: bool | None = None
    qk_norm: str | None = None
    eps: float | None = None
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    pos_embed_seq_len: int | None = None
    rope_max_seq_len: int | None = None
    experts: int | None = None
    boundary_ratio: float | None = None
    expand_timesteps: bool | None = None
    recompute: Literal["none", "full", "selective"] = "none"
    init_from_diffusers: str | None = None

    def wan(self) -> WanConfig:
        """The preset with this config's overrides applied (validated by :class:`WanConfig`)."""
        changes = {name: getattr(self, name) for name in WAN_FIELDS if getattr(self, name) is not None}
        return wan_preset(self.preset).replace(**changes)

    def validate(self, path: str) -> None:
        if self.preset not in PRESETS:
            wan_preset(self.preset)  # raises with the known names and the closest one
        self.wan()
        if self.init_from_diffusers is not None and not Path(self.init_from_diffusers).is_dir():
            raise LoongError(f"{path}.init_from_diffusers: {self.init_from_diffusers} is not a folder "
                             "(expected a diffusers WanTransformer3DModel folder with config.json)")


@dataclass
class SyntheticVideoConfig:
    """The synthetic "moving shapes" latents (sizes in latent units, before patching) and their text features.

    ``num_clips`` clips, each a blob of one of ``num_classes`` motions and channel patterns; the class also seeds
    the clip's ``text_len`` text-feature vectors. ``text_drop_prob``: classifier-free-guidance dropout (the text
    features of a sample replaced by zeros with this probability).
    """

    num_clips: int = 64
    num_classes: int = 8
    frames: int = 4
    height: int = 16
    width: int = 16
    text_len: int = 8
    text_drop_prob: float = 0.1
    seed: int = 0

    def validate(self, path: str) -> None:
        for name in ("num_clips", "num_classes", "frames", "height", "width", "text_len"):
            if getattr(self, name) < 1:
                raise LoongError(f"{path}.{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.text_drop_prob <= 1.0:
            raise LoongError(f"{path}.text_drop_prob: a probability in [0, 1], got {self.text_drop_prob}")


@dataclass
class DiffusionTrainConfig(TrainConfig):
    """The core schedule plus flow matching: σ from ``timestep_sampling`` (``uniform`` on [0, 1], or
    ``logit_normal``: sigmoid of N(``logit_mean``, ``logit_std``²)), then Wan's shift
    σ' = shift·σ / (1 + (shift − 1)·σ) with ``timestep_shift`` (1: none; larger: noisier timesteps)."""

    timestep_sampling: Literal["uniform", "logit_normal"] = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    timestep_shift: float = 1.0

    def validate(self, path: str) -> None:
        super().validate(path)
        if self.timestep_shift <= 0:
            raise LoongError(f"{path}.timestep_shift: must be > 0 (1 = no shift), got {self.timestep_shift}")
        if self.logit_std <= 0:
            raise LoongError(f"{path}.logit_std: must be > 0, got {self.logit_std}")


@dataclass
class DiffusionRunConfig(RunConfig):
    """``loong-diffusion train`` config: the Wan model, synthetic video data, flow matching on the fsdp engine."""

    task: str = "diffusion.wan"
    engine: str = "fsdp"
    model: WanModelConfig = field(default_factory=WanModelConfig)
    data: SyntheticVideoConfig = field(default_factory=SyntheticVideoConfig)  # type: ignore[assignment]
    train: DiffusionTrainConfig = field(default_factory=DiffusionTrainConfig)


__all__ = ["WAN_FIELDS", "DiffusionRunConfig", "DiffusionTrainConfig", "SyntheticVideoConfig", "WanModelConfig"]
