"""Flow matching as Wan trains: x_t = (1 − σ)·x₀ + σ·ε, the target ε − x₀, the timestep 1000·σ.

σ comes from uniform or logit-normal sampling, then Wan's shift σ' = shift·σ / (1 + (shift − 1)·σ); the text
condition is dropped (zeros) with probability ``text_drop_prob`` for classifier-free guidance. A sample's noise, σ
and drop come from a generator seeded by (seed, sample index), so every parallel layout and a resumed run draw
the same ones.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

#: Wan's timesteps run over [0, 1000]
NUM_TRAIN_TIMESTEPS = 1000


def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's (and SD3's) timestep shift: ``shift·σ / (1 + (shift − 1)·σ)``; 1 leaves σ unchanged."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def unshift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """The inverse of :func:`shift_sigma`: ``σ' / (shift − (shift − 1)·σ')``."""
    return sigma / (shift - (shift - 1) * sigma)


def _cdf(sigma: torch.Tensor, sampling: str, logit_mean: float, logit_std: float) -> torch.Tensor:
    """P(σ ≤ ``sigma``) before the shift: σ itself (uniform) or Φ((logit σ − mean) / std) (logit-normal)."""
    if sampling == "uniform":
        return sigma
    return torch.special.ndtr((torch.logit(sigma) - logit_mean) / logit_std)


def sample_sigma(generator: torch.Generator, sampling: Literal["uniform", "logit_normal"], shift: float = 1.0,
                 logit_mean: float = 0.0, logit_std: float = 1.0,
                 sigma_range: tuple[float, float] = (0.0, 1.0)) -> torch.Tensor:
    """One σ in [0, 1] (a 0-d tensor): uniform, or sigmoid of N(``logit_mean``, ``logit_std``²); then shifted.

    ``sigma_range`` ``[lo, hi]`` (after the shift; a Wan 2.2 A14B expert's share of the timesteps) draws from the
    same distribution conditioned on that range: a uniform quantile between the range's two quantiles, mapped
    through the inverse distribution function and the shift (both monotone). The full range keeps the plain draw.
    """
    lo, hi = sigma_range
    if (lo, hi) == (0.0, 1.0):
        if sampling == "uniform":
            sigma = torch.rand((), generator=generator)
        else:
            sigma = torch.sigmoid(logit_mean + logit_std * torch.randn((), generator=generator))
        return shift_sigma(sigma, shift)
    q_lo, q_hi = (_cdf(unshift_sigma(torch.tensor(x, dtype=torch.float64), shift), sampling, logit_mean, logit_std)
                  for x in (lo, hi))
    q = q_lo + (q_hi - q_lo) * torch.rand((), generator=generator, dtype=torch.float64)
    sigma = q if sampling == "uniform" else torch.sigmoid(logit_mean + logit_std * torch.special.ndtri(q))
    return shift_sigma(sigma, shift).clamp(lo, hi).float()


@functools.lru_cache(maxsize=16)  # a run asks for the same few ranges at every step (A14B's per-step expert)
def sigma_mass(sampling: Literal["uniform", "logit_normal"], shift: float, logit_mean: float, logit_std: float,
               sigma_range: tuple[float, float]) -> float:
    """The probability that :func:`sample_sigma` over the full range lands in ``sigma_range``."""
    lo, hi = (_cdf(unshift_sigma(torch.tensor(x, dtype=torch.float64), shift), sampling, logit_mean, logit_std)
              for x in sigma_range)
    return float(hi - lo)


def noisy_sample(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, target)`` = ``((1 − σ)·x₀ + σ·ε, ε − x₀)``; ``sigma`` broadcasts against ``x0``."""
    return (1 - sigma) * x0 + sigma * noise, noise - x0


def flow_sample(x0: torch.Tensor, text: torch.Tensor, seed: int, index: int, *, sampling: Literal["uniform",
                "logit_normal"] = "uniform", shift: float = 1.0, logit_mean: float = 0.0, logit_std: float = 1.0,
                text_drop_prob: float = 0.0, sigma_range: tuple[float, float] = (0.0, 1.0)) -> dict[str, torch.Tensor]:
    """Sample ``index`` of a run seeded ``seed`` as the model trains on it: ``noisy`` x_t, ``target`` ε − x₀,
    ``timestep`` 1000·σ (0-d), ``text`` (zeros when dropped) and ``sigma`` (drawn within ``sigma_range``)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    sigma = sample_sigma(g, sampling, shift, logit_mean, logit_std, sigma_range)
    drop = bool(torch.rand((), generator=g) < text_drop_prob)
    noise = torch.randn(x0.shape, generator=g, dtype=x0.dtype)
    noisy, target = noisy_sample(x0, noise, sigma)
    return {"noisy": noisy, "target": target, "timestep": NUM_TRAIN_TIMESTEPS * sigma, "sigma": sigma,
            "text": torch.zeros_like(text) if drop else text}


__all__ = ["NUM_TRAIN_TIMESTEPS", "flow_sample", "noisy_sample", "sample_sigma", "shift_sigma", "sigma_mass",
           "unshift_sigma"]
