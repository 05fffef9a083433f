"""Per-embodiment projections: one weight matrix per robot ("category"), picked by ``embodiment_id``.

GR00T serves robots of different bodies with one model: the state encoder, the action encoder and the action
decoder keep a separate linear map for each of ``num_embodiments`` embodiments and gather the one each sample
names. Parameter names (``W``, ``b``, ``layer1``, ``W1``...) are those of the published GR00T checkpoints.
"""

from __future__ import annotations

import math
import struct

import torch
import torch.nn.functional as F
from torch import nn

from loong.core.errors import LoongError


def check_embodiment_ids(emb: torch.Tensor, num_embodiments: int, where: str, key: str = "embodiment_id") -> None:
    """Refuse embodiment ids outside ``[0, num_embodiments)`` (a LoongError naming ``key``). It reads the values, so
    the processors call it, not the step: on a GPU an id out of range indexes the per-embodiment weights with a
    device assert."""
    if emb.numel() and (int(emb.max()) >= num_embodiments or int(emb.min()) < 0):
        raise LoongError(f"{where}: {key} must be in [0, {num_embodiments}), got {emb.tolist()}")


class CategorySpecificLinear(nn.Module):
    """``y = x @ W[id] + b[id]``: ``W`` ``[num_categories, in, out]``, ``b`` ``[num_categories, out]``."""

    def __init__(self, num_categories: int, input_dim: int, output_dim: int) -> None:
        super().__init__()
        self.num_categories = num_categories
        # GR00T's init: small random weights, zero bias
        self.W = nn.Parameter(0.02 * torch.randn(num_categories, input_dim, output_dim))
        self.b = nn.Parameter(torch.zeros(num_categories, output_dim))

    def forward(self, x: torch.Tensor, category_ids: torch.Tensor) -> torch.Tensor:
        """``x`` ``[b, t, in]``, ``category_ids`` ``[b]`` -> ``[b, t, out]``."""
        return torch.bmm(x, self.W[category_ids]) + self.b[category_ids].unsqueeze(1)


class CategorySpecificMLP(nn.Module):
    """Two per-embodiment linears with a ReLU between (the state encoder and the action decoder)."""

    def __init__(self, num_categories: int, input_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        self.layer1 = CategorySpecificLinear(num_categories, input_dim, hidden_dim)
        self.layer2 = CategorySpecificLinear(num_categories, hidden_dim, output_dim)

    def forward(self, x: torch.Tensor, category_ids: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.relu(self.layer1(x, category_ids)), category_ids)


def _fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (a division of two fp32 values done in double and rounded once to
    fp32 is the fp32 division: double has more than twice fp32's precision)."""
    return struct.unpack("f", struct.pack("f", x))[0]


#: ``torch.log(torch.tensor(10000.0))``: fp32 ln(10000) as GR00T computes it
_LN_10000 = _fp32(math.log(10000.0))


def sinusoidal_time_encoding(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """``[..., dim]`` ``[sin | cos]`` encoding of (discretised) flow times ``[...]`` (GR00T's action-encoder
    time features: frequencies ``exp(-i * ln(10000) / (dim / 2))``, computed in fp32)."""
    timesteps = timesteps.float()
    half = dim // 2
    # GR00T's fp32 scalar log(10000) / half (a host tensor there), as a Python float of the same fp32 value: a tensor
    # of host data would be a host-to-device copy in the step
    exponent = -torch.arange(half, dtype=torch.float32, device=timesteps.device) * _fp32(_LN_10000 / half)
    freqs = timesteps.unsqueeze(-1) * exponent.exp()
    return torch.cat([torch.sin(freqs), torch.cos(freqs)], dim=-1)


class MultiEmbodimentActionEncoder(nn.Module):
    """Noisy action chunk + flow time -> action tokens ``[b, horizon, hidden]``.

    ``W1`` embeds each action, the sinusoidal time encoding is concatenated, ``W2`` (swish) mixes them and ``W3``
    projects: all three per embodiment.
    """

    def __init__(self, action_dim: int, hidden_size: int, num_embodiments: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.W1 = CategorySpecificLinear(num_embodiments, action_dim, hidden_size)
        self.W2 = CategorySpecificLinear(num_embodiments, 2 * hidden_size, hidden_size)
        self.W3 = CategorySpecificLinear(num_embodiments, hidden_size, hidden_size)

    def forward(self, actions: torch.Tensor, timesteps: torch.Tensor, category_ids: torch.Tensor) -> torch.Tensor:
        """``actions`` ``[b, horizon, action_dim]``, ``timesteps`` ``[b]`` (discretised), ``category_ids`` ``[b]``."""
        batch, horizon, _ = actions.shape
        if timesteps.dim() != 1 or timesteps.shape[0] != batch:
            raise ValueError(f"timesteps must have shape ({batch},), got {tuple(timesteps.shape)}")
        action_emb = self.W1(actions, category_ids)
        time_emb = sinusoidal_time_encoding(timesteps.unsqueeze(1).expand(-1, horizon), self.hidden_size)
        x = torch.cat([action_emb, time_emb.to(action_emb.dtype)], dim=-1)
        x = self.W2(x, category_ids)
        return self.W3(x * torch.sigmoid(x), category_ids)  # swish, written out as GR00T does


__all__ = [
    "CategorySpecificLinear",
    "CategorySpecificMLP",
    "MultiEmbodimentActionEncoder",
    "sinusoidal_time_encoding",
]
