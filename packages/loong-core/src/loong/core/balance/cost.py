"""Per-sample compute cost model for data-parallel load balancing.

The cost of one sample of ``len`` tokens is modelled as ``a*len**2 + b*len + c``: the quadratic term
is attention, the linear term the token-wise layers (MLP, projections, norms), the constant the
per-sample overhead (kernel launches, padding, data movement). A sample that also runs an encoder
of its own (a vision tower over ``enc`` patch tokens, e.g. ``T·H·W`` for a video) adds
``enc_a*enc**2 + enc_b*enc`` for that part, with its own coefficients. A rank's step time is the sum of its
samples' costs, so the coefficients can be fitted from measured per-rank step times with
:func:`fit_cost_model`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["CostModel", "fit_cost_model", "rank_features"]


@dataclass(frozen=True)
class CostModel:
    """``cost = a*len**2 + b*len + c + enc_a*enc**2 + enc_b*enc`` (non-negative when fitted)."""

    a: float
    b: float
    c: float = 0.0
    enc_a: float = 0.0
    enc_b: float = 0.0

    def cost(self, lengths: ArrayLike, encoder_lengths: ArrayLike | None = None) -> np.ndarray:
        """Vectorised per-sample cost of ``lengths`` (and encoder tokens, same shape), as float64."""
        x = np.asarray(lengths, dtype=np.float64)
        out = (self.a * x + self.b) * x + self.c
        if encoder_lengths is not None:
            e = np.asarray(encoder_lengths, dtype=np.float64)
            out = out + (self.enc_a * e + self.enc_b) * e
        return out

    def rank_cost(self, lengths: ArrayLike, encoder_lengths: ArrayLike | None = None) -> float:
        """Total cost of one rank holding samples of ``lengths``."""
        return float(self.cost(lengths, encoder_lengths).sum())

    def coefficients(self) -> list[float]:
        """``[a, b, c, enc_a, enc_b]``."""
        return [self.a, self.b, self.c, self.enc_a, self.enc_b]


def rank_features(lengths: ArrayLike, encoder_lengths: ArrayLike | None = None) -> np.ndarray:
    """Regression features of one rank's step: ``(sum len**2, sum len, count, sum enc**2, sum enc)``."""
    x = np.asarray(lengths, dtype=np.float64).ravel()
    e = np.zeros(0) if encoder_lengths is None else np.asarray(encoder_lengths, dtype=np.float64).ravel()
    return np.array([np.dot(x, x), x.sum(), float(x.size), np.dot(e, e), e.sum()])


def _nnls_small(features: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of unknowns by active-set enumeration.

    The NNLS optimum has some support ``S`` on which it equals the unconstrained least-squares
    solution restricted to ``S``; every feasible (non-negative) restricted solution is a feasible
    point of the NNLS problem. So the best feasible restricted solution over all ``2**k - 1``
    non-empty subsets (plus the all-zero vector) is the NNLS optimum. Columns are scaled to unit
    norm first so that ``len**2`` (~1e10) and ``count`` (~1) are solved with similar conditioning.
    """
    k = features.shape[1]
    norms = np.linalg.norm(features, axis=0)
    scale = np.where(norms > 0, norms, 1.0)
    xs = features / scale
    best = np.zeros(k)
    best_res = float(np.dot(targets, targets))
    for size in range(1, k + 1):
        for subset in itertools.combinations(range(k), size):
            cols = list(subset)
            if np.any(norms[cols] == 0):
                continue
            sol, *_ = np.linalg.lstsq(xs[:, cols], targets, rcond=None)
            if np.any(sol < 0):
                continue
            coef = np.zeros(k)
            coef[cols] = sol
            resid = targets - xs @ coef
            res = float(np.dot(resid, resid))
            if res < best_res - 1e-12 * max(best_res, 1.0):
                best, best_res = coef, res
    return best / scale


def fit_cost_model(
    per_step_rank_lengths: Sequence[Sequence[ArrayLike]],
    measured_times: Sequence[Sequence[float]] | ArrayLike,
    per_step_rank_encoder_lengths: Sequence[Sequence[ArrayLike]] | None = None,
) -> CostModel:
    """Fit non-negative coefficients to measured per-rank step times.

    Args:
        per_step_rank_lengths: ``[step][rank]`` -> the sample lengths that rank processed that step.
        measured_times: ``[step][rank]`` -> that rank's measured compute time (same nesting).
        per_step_rank_encoder_lengths: optional ``[step][rank]`` -> the encoder tokens of those
            samples; without it the encoder coefficients are 0.

    Each (step, rank) pair is one observation with the features of :func:`rank_features`.
    Ranks may differ in number per step; the arguments must match in shape.
    """
    rows: list[np.ndarray] = []
    targets: list[float] = []
    if len(per_step_rank_lengths) != len(measured_times):
        raise ValueError(
            f"per_step_rank_lengths has {len(per_step_rank_lengths)} steps but measured_times has "
            f"{len(measured_times)}"
        )
    for step, (ranks, times) in enumerate(zip(per_step_rank_lengths, measured_times, strict=True)):
        times = np.asarray(times, dtype=np.float64).ravel()
        if len(ranks) != times.size:
            raise ValueError(f"step {step}: {len(ranks)} ranks of lengths but {times.size} measured times")
        encoders = (per_step_rank_encoder_lengths[step] if per_step_rank_encoder_lengths is not None
                    else [None] * len(ranks))
        for lengths, enc, t in zip(ranks, encoders, times, strict=True):
            rows.append(rank_features(lengths, enc))
            targets.append(float(t))
    if not rows:
        raise ValueError("fit_cost_model needs at least one (step, rank) observation")
    y = np.asarray(targets)
    if not np.all(np.isfinite(y)):
        raise ValueError("measured_times contains non-finite values")
    return CostModel(*(float(v) for v in _nnls_small(np.vstack(rows), y)))
