"""The run schema of ``loong-diffusion train``: the core run config with typed ``model``, ``data`` and ``train``.

Flow-matching keys live in ``train`` (``train.timestep_sampling``, ``train.timestep_shift``, ...), as the issue
names them: they shape the optimisation target, not the data on disk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Literal

from loong.core.config.checks import (
    KEEPS_RUN,
    Check,
    ExistingDir,
    NonEmptyStr,
    PositiveFloat,
    PositiveInt,
    Probability,
)
from loong.core.config.schema import RunConfig, TrainConfig
from loong.core.errors import LoongError
from loong.diffusion.models.wan.config import PRESETS, WanConfig, wan_preset

#: WanConfig fields a run may override on top of its preset (every field of the dataclass)
WAN_FIELDS = tuple(f.name for f in dataclasses.fields(WanConfig))


@dataclass
class WanModelConfig:
    """The Wan transformer of a run: ``preset`` (a :data:`~loong.diffusion.models.wan.config.PRESETS` name), then
    any :class:`WanConfig` field overriding it (``None``: the preset's value).

    ``expert`` (Wan 2.2 A14B, ``experts=2``): ``high_noise`` or ``low_noise`` trains that expert alone on its
    timestep range; ``both`` trains the pair, each step one expert (:mod:`loong.diffusion.experts`).
    ``recompute``: the fsdp engine's activation recomputation (``selective``: each block's MLP). ``init_from_diffusers``:
    a diffusers ``WanTransformer3DModel`` folder whose weights start a fresh run (its config must equal this one).
    """

    preset: NonEmptyStr = "tiny"
    num_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    ffn_dim: PositiveInt | None = None
    num_layers: PositiveInt | None = None
    in_channels: PositiveInt | None = None
    out_channels: PositiveInt | None = None
    text_dim: PositiveInt | None = None
    freq_dim: PositiveInt | None = None
    patch_size: list[PositiveInt] | None = None
    cross_attn_norm: bool | None = None
    qk_norm: NonEmptyStr | None = None
    eps: PositiveFloat | None = None
    image_dim: PositiveInt | None = None
    added_kv_proj_dim: PositiveInt | None = None
    pos_embed_seq_len: PositiveInt | None = None
    rope_max_seq_len: PositiveInt | None = None
    experts: Annotated[int, Check(ge=1, le=2)] | None = None
    boundary_ratio: Annotated[float, Check(gt=0, lt=1)] | None = None
    expand_timesteps: bool | None = None
    recompute: Literal["none", "full", "selective"] = "none"
    init_from_diffusers: ExistingDir | None = None
    expert: Literal["both", "high_noise", "low_noise"] = "both"

    def wan(self) -> WanConfig:
        """The preset with this config's overrides applied (validated by :class:`WanConfig`)."""
        changes = {name: getattr(self, name) for name in WAN_FIELDS if getattr(self, name) is not None}
        return wan_preset(self.preset).replace(**changes)

    def validate(self, path: str) -> None:
        if self.preset not in PRESETS:
            wan_preset(self.preset)  # raises with the known names and the closest one
        wan = self.wan()
        if self.expert != "both" and wan.experts == 1:
            raise LoongError(f"{path}.expert={self.expert}: model.preset={self.preset} has one expert; "
                             "high_noise/low_noise pick one of the two experts of a Wan 2.2 A14B preset")


@dataclass
class SyntheticVideoConfig:
    """The synthetic "moving shapes" latents (sizes in latent units, before patching) and their text features.

    ``num_clips`` clips, each a blob of one of ``num_classes`` motions and channel patterns; the class also seeds
    the clip's ``text_len`` text-feature vectors. ``text_drop_prob``: classifier-free-guidance dropout (the text
    features of a sample replaced by zeros with this probability).

    ``source``: ``synthetic`` (the above) or ``shards``: the clips of ``path``, a ``loong-diffusion preprocess``
    output folder (``frames``/``height``/``width``/``num_*`` then unused; each global batch is one bucket; text
    zero-padded to ``text_len``, Wan: 512).

    Image-to-video models (:mod:`loong.diffusion.conditioning`): ``image_len`` CLIP tokens per conditioning image
    (Wan 2.1 I2V; synthetic features per class); ``image_cond_prob`` the share of Wan 2.2 TI2V samples conditioned on
    their first frame (the rest train text-to-video).

    ``sizes``: several latent sizes ``[frames, height, width]`` (resolution/duration buckets) replacing the one
    ``frames × height × width``; each synthetic clip draws one (null: the one size). ``pack_tokens``: packing, the
    most video tokens of one training micro-batch (several clips of any sizes in one sequence, balanced over the
    data-parallel ranks); 0: no packing, each micro-batch stacks ``train.micro_batch_size`` clips of one size.
    """

    source: Literal["synthetic", "shards"] = "synthetic"
    path: str | None = None

    num_clips: PositiveInt = 64
    num_classes: PositiveInt = 8
    frames: PositiveInt = 4
    height: PositiveInt = 16
    width: PositiveInt = 16
    text_len: PositiveInt = 8
    text_drop_prob: Probability = 0.1
    seed: Annotated[int, Check(ge=0, le=2**32 - 1)] = 0
    sizes: Annotated[list[list[PositiveInt]], Check(nonempty=True)] | None = None
    pack_tokens: Annotated[int, Check(ge=0, note="0: no packing")] = 0
    image_len: Annotated[int, Check(ge=1, note="ViT-H/14 at 224 px: 257")] = 257
    image_cond_prob: Probability = 0.5

    def latent_sizes(self) -> list[tuple[int, int, int]]:
        """The synthetic clips' latent ``(frames, height, width)`` sizes: ``sizes``, or the one size."""
        return [tuple(s) for s in self.sizes] if self.sizes else [(self.frames, self.height, self.width)]  # type: ignore[misc]

    def validate(self, path: str) -> None:
        for i, size in enumerate(self.sizes or []):
            if len(size) != 3:
                raise LoongError(f"{path}.sizes[{i}]={size}: a latent size [frames, height, width] of integers >= 1")
        if self.source == "shards":
            if not self.path:
                raise LoongError(f"{path}.path: required with {path}.source=shards (the output folder of "
                                 "loong-diffusion preprocess)")
            from loong.diffusion.data.shards import read_index

            read_index(self.path, f"{path}.path")  # exists, is a finished preprocess folder
        elif self.path is not None:
            raise LoongError(f"{path}.path: only read with {path}.source=shards (got {path}.source={self.source}); "
                             f"set {path}.source=shards to train on {self.path}")


@dataclass
class DiffusionTrainConfig(TrainConfig):
    """The core schedule plus flow matching: σ from ``timestep_sampling`` (``uniform`` on [0, 1], or
    ``logit_normal``: sigmoid of N(``logit_mean``, ``logit_std``²)), then Wan's shift
    σ' = shift·σ / (1 + (shift − 1)·σ) with ``timestep_shift`` (1: none; larger: noisier timesteps)."""

    timestep_sampling: Literal["uniform", "logit_normal"] = "uniform"
    logit_mean: float = 0.0
    logit_std: PositiveFloat = 1.0
    timestep_shift: Annotated[float, Check(gt=0, note="1: no shift")] = 1.0
    # loong-diffusion's name for the core's save_hf: either writes the trained weights (train.export_ema: their
    # moving averages) to <run>/hf/ as a diffusers WanTransformer3DModel folder; one export, two spellings
    save_diffusers: Annotated[bool, KEEPS_RUN] = False
    # every preview_interval steps (0: never) a GIF of the synthetic classes denoised in preview_steps UniPC steps
    # with guidance preview_guidance, the latents shown as colours, at <run>/previews/step_N.gif: what
    # `loong-diffusion sample RUN --seed <train.seed> --steps <preview_steps> --guidance <preview_guidance>` draws
    preview_interval: Annotated[int, Check(ge=0, note="0: never"), KEEPS_RUN] = 0
    preview_steps: Annotated[int, Check(ge=1), KEEPS_RUN] = 20
    preview_guidance: Annotated[float, Check(ge=0), KEEPS_RUN] = 5.0

    def validate(self, path: str) -> None:
        super().validate(path)
        self.save_hf = self.save_diffusers = self.save_hf or self.save_diffusers


@dataclass
class DiffusionRunConfig(RunConfig):
    """``loong-diffusion train`` config: the Wan model, synthetic video data, flow matching on the fsdp engine."""

    task: str = "diffusion.wan"
    engine: str = "fsdp"
    model: WanModelConfig = field(default_factory=WanModelConfig)
    data: SyntheticVideoConfig = field(default_factory=SyntheticVideoConfig)  # type: ignore[assignment]
    train: DiffusionTrainConfig = field(default_factory=DiffusionTrainConfig)


__all__ = ["WAN_FIELDS", "DiffusionRunConfig", "DiffusionTrainConfig", "SyntheticVideoConfig", "WanModelConfig"]
