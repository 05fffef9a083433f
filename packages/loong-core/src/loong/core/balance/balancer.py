"""Per-step data-parallel balancing for a training run: plan, redistribute by index, measure, fit.

Every rank holds the whole dataset (or can read any sample by index), so redistribution needs no
communication: each rank computes the same deterministic plan of the global batch from the step
number, the seed and the samples' lengths, and reads the samples the plan gives it. Determinism is
what keeps every sample used exactly once, so refinement is bounded by an operation count, never by
wall time (ranks on differently loaded hosts would otherwise plan differently).

With ``data.balance.cost=fit`` the balancer also measures: after each step it gathers every
data-parallel rank's compute time and, after ``fit_steps`` observations, fits
``a*len**2 + b*len + c`` by non-negative least squares and plans with it from then on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from loong.core.balance.cost import CostModel, fit_cost_model
from loong.core.balance.planner import plan

__all__ = ["DataBalancer", "StepPlan"]


@dataclass
class StepPlan:
    """The plan of one global batch.

    Attributes:
        micro_batches: ``micro_batches[rank][k]`` -> positions (into the step's sample list) of
            rank ``rank``'s micro-batch ``k``; every rank has the same number, some may be empty.
        lengths: the step's sample lengths (tokens), by position.
        encoder_lengths: the samples' encoder tokens (e.g. vision patches), or None.
        before: ``max / mean`` rank cost of the default (unbalanced) assignment.
        after: ``max / mean`` rank cost of the plan.
        seconds: planning wall time.
    """

    micro_batches: list[list[list[int]]]
    lengths: np.ndarray
    encoder_lengths: np.ndarray | None
    before: float
    after: float
    seconds: float

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank this step."""
        return len(self.micro_batches[0])

    def rank_lengths(self, rank: int, encoder: bool = False) -> np.ndarray | None:
        """Lengths (or encoder lengths) of every sample ``rank`` processes this step."""
        source = self.encoder_lengths if encoder else self.lengths
        if source is None:
            return None
        return source[[p for mb in self.micro_batches[rank] for p in mb]]


def _imbalance(costs: np.ndarray, ranks: np.ndarray, num_ranks: int) -> float:
    loads = np.bincount(ranks, weights=costs, minlength=num_ranks)
    mean = loads.sum() / num_ranks
    return float(loads.max() / mean) if mean > 0 else 1.0


class DataBalancer:
    """Plans each step's global batch over data-parallel ranks; optionally fits the cost online.

    Args:
        cost: ``"flops"``, ``"fit"`` or ``[a, b, c]`` / ``[a, b, c, enc_a, enc_b]`` (``data.balance.cost``).
        default_model: the task's analytic cost (used for ``flops`` and until a ``fit`` is ready).
        dp_size: number of data-parallel ranks.
        seed: seeds tie-breaking (combined with the step).
        fit_steps: observations (steps) before fitting, for ``cost="fit"``.
        dp_group: the data-parallel process group the compute times are gathered over.
    """

    def __init__(self, cost: str | Sequence[float], default_model: CostModel, dp_size: int, seed: int,
                 fit_steps: int = 8, dp_group: Any = None) -> None:
        self.model = default_model if isinstance(cost, str) else CostModel(*map(float, cost))
        self.fitting = cost == "fit"
        self.fitted = False
        self.dp_size, self.seed, self.fit_steps, self.dp_group = dp_size, seed, fit_steps, dp_group
        self.observed_lengths: list[list[list[int]]] = []  # [step][rank] -> lengths
        self.observed_encoder: list[list[list[int]]] = []  # [step][rank] -> encoder lengths
        self.observed_times: list[list[float]] = []  # [step][rank] -> compute seconds
        self._skipped_first = False

    @property
    def measures_time(self) -> bool:
        """Whether the caller should pass measured compute times to :meth:`observe`."""
        return self.fitting and not self.fitted

    def plan_step(self, step: int, lengths: Sequence[int], default_ranks: Sequence[int],
                  micro_batches: int, capacity: int | None,
                  encoder_lengths: Sequence[int] | None = None) -> StepPlan:
        """Assign the step's samples (``lengths``, in batch order) to ranks and micro-batches.

        ``default_ranks`` is where each sample goes without balancing (for the *before* figure);
        ``capacity`` bounds the real tokens of one micro-batch (``micro_batches`` is the minimum
        count per rank, more are opened when a rank's samples do not fit); ``encoder_lengths``
        are the samples' encoder tokens where a modality has them.
        """
        lens = np.asarray(lengths, dtype=np.int64)
        enc = None if encoder_lengths is None else np.asarray(encoder_lengths, dtype=np.int64)
        costs = self.model.cost(lens, enc)
        result = plan(costs, self.dp_size, micro_batches, lengths=lens, capacity=capacity,
                      seed=self.seed * 1_000_003 + step, max_iters=20 * lens.size + 100)
        before = _imbalance(costs, np.asarray(default_ranks, dtype=np.int64), self.dp_size)
        return StepPlan(result.assignment, lens, enc, before, result.imbalance, result.seconds)

    def observe(self, step_plan: StepPlan, compute_seconds: float, device: torch.device) -> dict[str, float]:
        """Record this rank's measured compute time (collective over the DP group); fit when ready.

        Returns metrics to log: the fitted coefficients on the step they are fitted.
        """
        if not self.measures_time:
            return {}
        times = [compute_seconds] * self.dp_size
        if self.dp_size > 1:
            t = torch.tensor([compute_seconds], dtype=torch.float64, device=device)
            gathered = [torch.zeros_like(t) for _ in range(self.dp_size)]
            dist.all_gather(gathered, t, group=self.dp_group)
            times = [float(g) for g in gathered]
        if not self._skipped_first:  # the first step pays one-off costs (allocation, autotuning)
            self._skipped_first = True
            return {}
        ranks = range(self.dp_size)
        self.observed_lengths.append([step_plan.rank_lengths(r).tolist() for r in ranks])
        if step_plan.encoder_lengths is not None:
            self.observed_encoder.append([step_plan.rank_lengths(r, encoder=True).tolist() for r in ranks])
        self.observed_times.append(times)
        if len(self.observed_times) < self.fit_steps:
            return {}
        encoder = self.observed_encoder if len(self.observed_encoder) == len(self.observed_times) else None
        self.model = fit_cost_model(self.observed_lengths, self.observed_times, encoder)
        self.fitted = True
        names = ("a", "b", "c", "enc_a", "enc_b") if encoder else ("a", "b", "c")
        return {f"balance_cost_{n}": getattr(self.model, n) for n in names}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to plan exactly as the uninterrupted one."""
        return {"model": self.model.coefficients(), "fitted": self.fitted,
                "skipped_first": self._skipped_first, "lengths": self.observed_lengths,
                "encoder": self.observed_encoder, "times": self.observed_times}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (an empty dict leaves the fresh state)."""
        if not state:
            return
        self.model = CostModel(*state["model"])
        self.fitted = bool(state["fitted"])
        self._skipped_first = bool(state["skipped_first"])
        self.observed_lengths = state["lengths"]
        self.observed_encoder = state.get("encoder", [])
        self.observed_times = state["times"]
