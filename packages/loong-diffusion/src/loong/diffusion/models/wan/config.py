"""The shape of a Wan 2.1 / 2.2 video transformer, its presets from ``tiny`` to the published checkpoints, and its
parameter count.

Every field of diffusers' ``WanTransformer3DModel`` config has a field here (``mapping.py`` converts between the two
names); ``experts`` and ``boundary_ratio`` describe the Wan 2.2 A14B pair of experts, which diffusers keeps in the
pipeline (``transformer`` / ``transformer_2``, ``boundary_ratio`` in ``model_index.json``), and
``expand_timesteps`` the Wan 2.2 TI2V per-token timesteps (also a pipeline flag there).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from loong.core.errors import LoongError, did_you_mean

#: diffusers' Wan transformer normalises q and k over all heads together; it has no other variant
QK_NORM = "rms_norm_across_heads"
#: the base of the rotary frequencies; fixed in Wan (diffusers has no config field for it)
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class WanConfig:
    """Shape and switches of one Wan transformer (one expert of the A14B pair).

    ``patch_size`` (t, h, w) cuts the latent ``[b, in_channels, frames, height, width]`` into tokens of width
    ``dim = num_heads * head_dim``. ``text_dim`` is the text encoder's width (UMT5-XXL: 4096), ``freq_dim`` the
    sinusoidal timestep width. ``image_dim`` (CLIP ViT-H: 1280) turns on the I2V image embedder and, with
    ``added_kv_proj_dim``, the image K/V projections of every cross-attention; ``pos_embed_seq_len`` is the
    first-last-frame model's learned position table over its two images' tokens. ``cross_attn_norm`` puts an
    affine LayerNorm before cross-attention. ``rope_max_seq_len`` is kept for diffusers (its RoPE table length);
    Loong computes rotary angles for any position.

    ``experts`` = 2 with ``boundary_ratio`` is Wan 2.2 A14B: the high-noise expert denoises timesteps
    ``>= boundary_ratio * 1000``, the low-noise expert the rest (:meth:`expert_for`). ``expand_timesteps`` is
    Wan 2.2 TI2V: the model takes a timestep per token, 0 on the tokens of the conditioning frame.
    """

    num_heads: int
    head_dim: int
    ffn_dim: int
    num_layers: int
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    patch_size: tuple[int, int, int] = (1, 2, 2)
    cross_attn_norm: bool = True
    qk_norm: str = QK_NORM
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    pos_embed_seq_len: int | None = None
    rope_max_seq_len: int = 1024
    experts: int = 1
    boundary_ratio: float | None = None
    expand_timesteps: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise LoongError(f"model.patch_size must be three positive sizes (t, h, w), got {self.patch_size}")
        if self.qk_norm != QK_NORM:
            raise LoongError(f"model.qk_norm must be {QK_NORM!r} (the only q/k norm Wan has), got {self.qk_norm!r}")
        if self.head_dim % 2 or self.head_dim < 6:
            raise LoongError(f"model.head_dim must be even and at least 6 (3-D RoPE), got {self.head_dim}")
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise LoongError("model.image_dim and model.added_kv_proj_dim go together (Wan 2.1 I2V); "
                             f"got image_dim={self.image_dim}, added_kv_proj_dim={self.added_kv_proj_dim}")
        if self.added_kv_proj_dim is not None and self.added_kv_proj_dim != self.dim:
            raise LoongError(f"model.added_kv_proj_dim projects the embedded image tokens (width dim = {self.dim}); "
                             f"got {self.added_kv_proj_dim}")
        if self.pos_embed_seq_len is not None and self.image_dim is None:
            raise LoongError("model.pos_embed_seq_len is the image embedder's position table; it needs image_dim")
        if self.experts not in (1, 2):
            raise LoongError(f"model.experts must be 1 or 2 (Wan 2.2 A14B), got {self.experts}")
        if (self.experts == 2) != (self.boundary_ratio is not None):
            raise LoongError("model.boundary_ratio switches between two experts: set it exactly when experts=2")
        if self.boundary_ratio is not None and not 0.0 < self.boundary_ratio < 1.0:
            raise LoongError(f"model.boundary_ratio must lie in (0, 1), got {self.boundary_ratio}")

    @property
    def dim(self) -> int:
        """The token width, ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def patch_volume(self) -> int:
        """Latent elements of one channel in one patch, ``t * h * w``."""
        return math.prod(self.patch_size)

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """Head channels rotated by the frame, row and column index: ``h = w = 2 * (head_dim // 6)``, the frame
        axis takes the rest (Wan's split: 44 / 42 / 42 of 128)."""
        hw = 2 * (self.head_dim // 6)
        return self.head_dim - 2 * hw, hw, hw

    def replace(self, **changes: object) -> WanConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def expert_for(self, timestep: float) -> Literal["high_noise", "low_noise"]:
        """Which A14B expert denoises ``timestep`` (0-1000): high-noise at or above ``boundary_ratio * 1000``,
        as diffusers' Wan pipelines switch from ``transformer`` to ``transformer_2``."""
        if self.boundary_ratio is None:
            raise LoongError("this Wan model has one expert; expert_for needs experts=2 with a boundary_ratio")
        return "high_noise" if timestep >= self.boundary_ratio * 1000 else "low_noise"

    def num_parameters(self, active: bool = False) -> int:
        """Parameters of the model (both experts of an A14B pair; ``active``: one expert, what a denoising step
        runs), counted from the shapes without building anything."""
        d, f = self.dim, self.ffn_dim

        def linear(i: int, o: int) -> int:
            return i * o + o

        embed = self.in_channels * self.patch_volume * d + d
        embed += linear(self.freq_dim, d) + linear(d, d) + linear(d, 6 * d)  # timestep MLP and modulation
        embed += linear(self.text_dim, d) + linear(d, d)
        if self.image_dim is not None:
            i = self.image_dim
            embed += 2 * i + linear(i, i) + linear(i, d) + 2 * d + (self.pos_embed_seq_len or 0) * i
        attention = 4 * linear(d, d) + 2 * d  # q, k, v, out and the q/k RMSNorm weights
        block = 6 * d + 2 * attention + linear(d, f) + linear(f, d)
        if self.cross_attn_norm:
            block += 2 * d
        if self.added_kv_proj_dim is not None:
            block += 2 * linear(self.added_kv_proj_dim, d) + d
        head = 2 * d + linear(d, self.out_channels * self.patch_volume)
        one = embed + self.num_layers * block + head
        return one if active else one * self.experts


_WAN21_14B = {"num_heads": 40, "head_dim": 128, "ffn_dim": 13824, "num_layers": 40}

#: tiny shapes for CPU runs and tests, then the published checkpoints (diffusers' ``Wan-AI/*-Diffusers`` folders)
PRESETS: dict[str, WanConfig] = {
    "tiny": WanConfig(num_heads=4, head_dim=16, ffn_dim=128, num_layers=2, text_dim=32, freq_dim=32),
    "tiny_i2v": WanConfig(num_heads=4, head_dim=16, ffn_dim=128, num_layers=2, text_dim=32, freq_dim=32,
                          in_channels=36, image_dim=24, added_kv_proj_dim=64),
    "tiny_ti2v": WanConfig(num_heads=4, head_dim=16, ffn_dim=128, num_layers=2, text_dim=32, freq_dim=32,
                           in_channels=48, out_channels=48, expand_timesteps=True),
    # the A14B pair in miniature: two experts switched at Wan 2.2 T2V's boundary
    "tiny_a14b": WanConfig(num_heads=4, head_dim=16, ffn_dim=128, num_layers=2, text_dim=32, freq_dim=32, experts=2,
                           boundary_ratio=0.875),
    "wan2_1_t2v_1_3b": WanConfig(num_heads=12, head_dim=128, ffn_dim=8960, num_layers=30),
    "wan2_1_t2v_14b": WanConfig(**_WAN21_14B),
    # 16 noise + 4 mask + 16 first-frame latent channels; CLIP ViT-H/14 image features through added K/V
    "wan2_1_i2v_14b": WanConfig(**_WAN21_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
    "wan2_1_flf2v_14b": WanConfig(**_WAN21_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120,
                                  pos_embed_seq_len=2 * 257),
    "wan2_2_ti2v_5b": WanConfig(num_heads=24, head_dim=128, ffn_dim=14336, num_layers=30, in_channels=48,
                                out_channels=48, expand_timesteps=True),
    "wan2_2_t2v_a14b": WanConfig(**_WAN21_14B, experts=2, boundary_ratio=0.875),
    # Wan 2.2 I2V has no CLIP image branch: the first frame enters only through the 36 input channels
    "wan2_2_i2v_a14b": WanConfig(**_WAN21_14B, in_channels=36, experts=2, boundary_ratio=0.9),
}


def wan_preset(name: str) -> WanConfig:
    """The preset ``name`` (see :data:`PRESETS`); an unknown name fails with the known ones."""
    if name not in PRESETS:
        raise LoongError(f"unknown Wan preset {name!r}{did_you_mean(name, PRESETS)}; "
                         f"known: {', '.join(PRESETS)}")
    return PRESETS[name]


__all__ = ["PRESETS", "QK_NORM", "ROPE_THETA", "WanConfig", "wan_preset"]
