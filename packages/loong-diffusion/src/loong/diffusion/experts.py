"""The two experts of Wan 2.2 A14B in one run: which timesteps each trains on, and the module that holds both.

A14B denoises with a high-noise expert at timesteps ``>= boundary_ratio · 1000`` and a low-noise expert below
(diffusers' ``transformer`` and ``transformer_2``). ``model.expert=high_noise|low_noise`` trains one of them: every
sample's σ is drawn from the run's timestep distribution conditioned on that expert's range
(:func:`~loong.diffusion.flow.sample_sigma`'s ``sigma_range``). ``model.expert=both`` trains the pair: each step
belongs to one expert, high-noise with the probability that the full distribution puts above the boundary, drawn
from (``train.seed``, step). A whole step on one expert keeps every rank's collectives in lockstep (the other
expert's blocks are neither gathered nor reduced that step and their optimiser state waits), and over many steps
each expert sees its share of the timesteps, as a model trained on the full distribution would.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from loong.diffusion.flow import sigma_mass
from loong.diffusion.models.wan.config import WanConfig

#: the A14B experts in diffusers' order (``transformer``, ``transformer_2``)
EXPERTS: tuple[str, str] = ("high_noise", "low_noise")
#: the stream offset of the per-step expert draw, so that it never coincides with a sample's generator
_EXPERT_STREAM = 15_485_863

Expert = Literal["high_noise", "low_noise"]


def expert_range(wan: WanConfig, expert: Expert | None) -> tuple[float, float]:
    """The σ range of ``expert`` (None: all of [0, 1]): high-noise ``[boundary, 1]``, low-noise ``[0, boundary]``."""
    if expert is None:
        return (0.0, 1.0)
    boundary = float(wan.boundary_ratio)  # type: ignore[arg-type]
    return (boundary, 1.0) if expert == "high_noise" else (0.0, boundary)


def step_expert(wan: WanConfig, train: Any, step: int) -> Expert:
    """The expert that step ``step`` of a ``model.expert=both`` run trains (``train``: the flow-matching keys)."""
    high = sigma_mass(train.timestep_sampling, train.timestep_shift, train.logit_mean, train.logit_std,
                      expert_range(wan, "high_noise"))
    g = torch.Generator().manual_seed(train.seed * 1_000_003 + _EXPERT_STREAM + step)
    return "high_noise" if float(torch.rand((), generator=g)) < high else "low_noise"


class ExpertPair(nn.Module):
    """Both experts' prediction modules; ``forward(..., expert=name)`` runs that one."""

    def __init__(self, high_noise: nn.Module, low_noise: nn.Module) -> None:
        super().__init__()
        self.high_noise = high_noise
        self.low_noise = low_noise

    def forward(self, *args: Any, expert: Expert, **kwargs: Any) -> torch.Tensor:
        return getattr(self, expert)(*args, **kwargs)


__all__ = ["EXPERTS", "Expert", "ExpertPair", "expert_range", "step_expert"]
