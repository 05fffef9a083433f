"""The condition embedders of Wan: timestep (sinusoid → MLP → the six-way modulation of every block), text (UMT5
features → two-layer GELU-tanh MLP) and, for Wan 2.1 I2V, CLIP image features (LayerNorm → GELU MLP → LayerNorm)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loong.diffusion.models.wan.config import WanConfig
from loong.diffusion.models.wan.norms import LayerNorm32

#: the longest period of the timestep sinusoid
MAX_PERIOD = 10000


def timestep_sinusoid(timestep: torch.Tensor, dim: int) -> torch.Tensor:
    """``[n, dim]`` float32 features of ``timestep [n]`` (0-1000, fractional allowed): cosines then sines of
    ``t * MAX_PERIOD^(-j / (dim/2))`` (the cos-first order of diffusers' ``flip_sin_to_cos``), zero-padded to an
    odd ``dim``."""
    half = dim // 2
    freqs = torch.exp(-math.log(MAX_PERIOD) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
    args = timestep[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, dim % 2))


class ImageEmbedder(nn.Module):
    """CLIP image tokens ``[b, n, image_dim]`` → ``[b, n, dim]``; with ``pos_embed_seq_len`` (first-last frame)
    the two images' token sequences are joined into one and given a learned position table first."""

    def __init__(self, config: WanConfig) -> None:
        super().__init__()
        if config.image_dim is None:
            raise ValueError("the image embedder needs config.image_dim (Wan 2.1 I2V)")
        i, d = config.image_dim, config.dim
        self.pos_embed = (nn.Parameter(torch.zeros(1, config.pos_embed_seq_len, i))
                          if config.pos_embed_seq_len is not None else None)
        # nn.LayerNorm's eps (1e-5), not the blocks' eps: what the published I2V weights were trained with
        self.norm_in = LayerNorm32(i, 1e-5)
        self.fc1 = nn.Linear(i, i)
        self.fc2 = nn.Linear(i, d)
        self.norm_out = LayerNorm32(d, 1e-5)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """Embed ``image [b, n, image_dim]`` (first-last frame: ``[2b, n, image_dim]``, the pairs adjacent)."""
        if self.pos_embed is not None:
            image = image.reshape(-1, self.pos_embed.shape[1], image.shape[-1]) + self.pos_embed
        return self.norm_out(self.fc2(F.gelu(self.fc1(self.norm_in(image)))))


class ConditionEmbedder(nn.Module):
    """Timestep, text and (I2V) image embeddings of one forward.

    ``timestep`` is ``[b]`` or, per token (Wan 2.2 TI2V), ``[b, tokens]``. Returns ``temb`` (``[b, dim]`` or
    ``[b, tokens, dim]``: the output head's modulation input), ``modulation`` (``[b, 6, dim]`` or
    ``[b, tokens, 6, dim]``: every block's shift/scale/gate), the text tokens ``[b, s_text, dim]`` and the image
    tokens (or None).
    """

    def __init__(self, config: WanConfig) -> None:
        super().__init__()
        d = config.dim
        self.freq_dim = config.freq_dim
        self.time_in = nn.Linear(config.freq_dim, d)
        self.time_out = nn.Linear(d, d)
        self.time_modulation = nn.Linear(d, 6 * d)
        self.text_in = nn.Linear(config.text_dim, d)
        self.text_out = nn.Linear(d, d)
        self.image = ImageEmbedder(config) if config.image_dim is not None else None

    def forward(self, timestep: torch.Tensor, text: torch.Tensor, image: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Embed the conditions of one batch (shapes in the class docstring)."""
        features = timestep_sinusoid(timestep.flatten(), self.freq_dim).unflatten(0, timestep.shape)
        # the timestep MLP runs in its weights' dtype (diffusers keeps it in fp32 under bf16), then joins the
        # activations' dtype
        features = features.to(self.time_in.weight.dtype)
        temb = self.time_out(F.silu(self.time_in(features))).to(text.dtype)
        modulation = self.time_modulation(F.silu(temb)).unflatten(-1, (6, -1))
        text = self.text_out(F.gelu(self.text_in(text), approximate="tanh"))
        if image is not None and self.image is not None:
            image = self.image(image)
        return temb, modulation, text, image


__all__ = ["ConditionEmbedder", "ImageEmbedder", "timestep_sinusoid"]
