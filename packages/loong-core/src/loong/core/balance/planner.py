"""Assign a global batch of samples to data-parallel ranks and micro-batches by compute cost.

Algorithm (:func:`plan`):

1. **LPT greedy.** Samples sorted by cost, descending, each given to the currently least-loaded rank
   (a heap). Equal costs and equal loads are ordered by a permutation drawn from ``seed``, so ties
   are broken deterministically but without always favouring rank 0.
2. **Refinement.** Repeatedly take the most loaded rank ``M`` (lowest index on ties) and apply the
   single best *move* (one of ``M``'s samples to another rank) or *swap* (one of ``M``'s samples for
   a cheaper sample of another rank) that lowers the larger of the two ranks' new loads the most;
   an operation is only applied when both new loads are strictly below ``M``'s old load, so the
   maximum never increases and the search terminates. It stops when ``M`` cannot be improved, after
   ``max_iters`` operations, or - only when ``max_iters`` is None - when ``time_budget_s`` of wall
   time since the start of :func:`plan` is spent. Given ``max_iters`` the result depends only on
   the inputs and the seed; under a pure time budget it is deterministic whenever refinement
   converges before the budget runs out (the usual case), otherwise it depends on machine speed.
3. **Micro-batches.** Each rank's samples (costliest first) go to its cheapest micro-batch that
   still has room for them under ``capacity`` tokens; if none has room, a micro-batch is opened.
   All ranks are then padded with empty micro-batches to the same count, so every rank runs the
   same number of micro-batches (collectives that run per micro-batch stay in lockstep).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["Plan", "plan"]


@dataclass
class Plan:
    """The result of :func:`plan`.

    Attributes:
        assignment: ``assignment[rank][micro_batch]`` -> sample indices into the input arrays.
            Every index appears exactly once; some micro-batches may be empty.
        max_cost: the largest per-rank total cost (what the step waits for).
        mean_cost: total cost / number of ranks (the ideal).
        greedy_max_cost: ``max_cost`` of the LPT greedy start, before refinement.
        seconds: wall time spent planning.
        rank_costs: per-rank total cost.
        iterations: refinement operations applied.
    """

    assignment: list[list[list[int]]]
    max_cost: float
    mean_cost: float
    greedy_max_cost: float
    seconds: float
    rank_costs: np.ndarray = field(default_factory=lambda: np.zeros(0))
    iterations: int = 0

    @property
    def imbalance(self) -> float:
        """``max_cost / mean_cost`` (1.0 is perfect; 1.0 for an empty batch)."""
        return self.max_cost / self.mean_cost if self.mean_cost > 0 else 1.0

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.assignment[0]) if self.assignment else 0


def _lpt(costs: np.ndarray, num_ranks: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """LPT greedy; returns (rank of each sample, rank loads)."""
    n = costs.size
    order = np.lexsort((rng.permutation(n), -costs))  # cost descending, seeded tie-break
    tie = rng.permutation(num_ranks)
    heap = [(0.0, int(tie[r]), r) for r in range(num_ranks)]
    heapq.heapify(heap)
    rank_of = np.empty(n, dtype=np.int64)
    loads = np.zeros(num_ranks)
    cost_list = costs.tolist()
    replace = heapq.heapreplace
    for i in order.tolist():
        load, t, r = heap[0]
        load += cost_list[i]
        rank_of[i] = r
        replace(heap, (load, t, r))
    for load, _, r in heap:
        loads[r] = load
    return rank_of, loads


def _refine(
    costs: np.ndarray,
    rank_of: np.ndarray,
    loads: np.ndarray,
    max_iters: int | None,
    deadline: float,
    good_enough: float,
    swap_ranks: int = 8,
) -> int:
    """Move/swap refinement around the most-loaded rank, in place; returns operations applied.

    Moves only target the least-loaded rank (the best move for any sample always does) and swaps
    only consider the ``swap_ranks`` least-loaded ranks, which keeps one iteration well under a
    millisecond for thousands of samples. Stops early once the maximum load is ``<= good_enough``.
    """
    num_ranks = loads.size
    if num_ranks < 2 or costs.size == 0:
        return 0
    limit = max_iters if max_iters is not None else 50 * costs.size + 100
    k_swap = min(swap_ranks, num_ranks - 1)
    done = 0
    while done < limit:
        if max_iters is None and time.perf_counter() > deadline:
            break
        m = int(np.argmax(loads))
        top = loads[m]
        if top <= good_enough:
            break
        tol = 1e-12 * top
        mine = np.flatnonzero(rank_of == m)
        ci = costs[mine]
        # Candidate partners: the k lightest ranks other than M, lightest first (stable order).
        light = np.argsort(loads, kind="stable")[: k_swap + 1]
        light = light[light != m][:k_swap]
        # Move: a sample of M to the lightest rank.
        r0 = int(light[0])
        move_score = np.maximum(top - ci, loads[r0] + ci)
        mv = int(np.argmin(move_score))
        best_move = move_score[mv]
        # Swap: sample i of M <-> cheaper sample j of a light rank.
        cand = np.flatnonzero(np.isin(rank_of, light))
        best_swap = np.inf
        if cand.size:
            d = ci[:, None] - costs[cand][None, :]
            swap_score = np.maximum(top - d, loads[rank_of[cand]][None, :] + d)
            swap_score[d <= 0] = np.inf
            sw = int(np.argmin(swap_score))
            best_swap = swap_score.flat[sw]
        if min(best_move, best_swap) >= top - tol:
            break  # M cannot be improved by these operations: local optimum
        if best_move <= best_swap:
            i = mine[mv]
            rank_of[i] = r0
            loads[m] -= costs[i]
            loads[r0] += costs[i]
        else:
            a, b = divmod(sw, cand.size)
            i, j = mine[a], cand[b]
            r = int(rank_of[j])
            delta = costs[i] - costs[j]
            rank_of[i], rank_of[j] = r, m
            loads[m] -= delta
            loads[r] += delta
        done += 1
    return done


def _split_micro_batches(
    members: list[int],
    costs: list[float],
    lengths: list[int] | None,
    micro_batches: int,
    capacity: int | None,
) -> list[list[int]]:
    """Split one rank's samples (already costliest first) into cost-balanced micro-batches."""
    if micro_batches == 1 and capacity is None:
        return [members]
    bins: list[list[int]] = [[] for _ in range(micro_batches)]
    bin_cost = [0.0] * micro_batches
    bin_tokens = [0] * micro_batches
    for i in members:
        best = -1
        for k in range(len(bins)):
            if capacity is not None and bin_tokens[k] + lengths[i] > capacity:  # type: ignore[index]
                continue
            if best < 0 or bin_cost[k] < bin_cost[best]:
                best = k
        if best < 0:
            bins.append([])
            bin_cost.append(0.0)
            bin_tokens.append(0)
            best = len(bins) - 1
        bins[best].append(i)
        bin_cost[best] += costs[i]
        if lengths is not None:
            bin_tokens[best] += lengths[i]
    return bins


def plan(
    costs: ArrayLike,
    num_ranks: int,
    micro_batches_per_rank: int = 1,
    lengths: ArrayLike | None = None,
    capacity: int | None = None,
    seed: int = 0,
    time_budget_s: float = 0.02,
    max_iters: int | None = None,
    tolerance: float = 1e-3,
) -> Plan:
    """Assign every sample to a (rank, micro-batch) minimising the maximum per-rank cost.

    Args:
        costs: per-sample cost (e.g. ``CostModel.cost(lengths)``), non-negative.
        num_ranks: data-parallel world size.
        micro_batches_per_rank: minimum micro-batches per rank (more are opened when ``capacity``
            requires; then every rank is padded with empty ones to the same count).
        lengths: per-sample token counts; required when ``capacity`` is given.
        capacity: maximum tokens per micro-batch, or None for no limit.
        seed: seeds tie-breaking, so equal inputs give equal plans.
        time_budget_s: wall-clock budget for the whole call, used by refinement only when
            ``max_iters`` is None (see the module docstring on determinism).
        max_iters: bound refinement by operation count instead of wall time (fully deterministic);
            0 returns the LPT greedy plan.
        tolerance: refinement stops once the maximum rank cost is within ``1 + tolerance`` of the
            lower bound ``max(mean rank cost, costliest sample)`` (no plan can do better).

    Raises:
        ValueError: bad sizes, negative/non-finite costs, ``capacity`` without ``lengths``, or a
            single sample longer than ``capacity``.
    """
    start = time.perf_counter()
    c = np.asarray(costs, dtype=np.float64).ravel()
    n = c.size
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if micro_batches_per_rank < 1:
        raise ValueError(f"micro_batches_per_rank must be >= 1, got {micro_batches_per_rank}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if max_iters is not None and max_iters < 0:
        raise ValueError(f"max_iters must be >= 0 or None, got {max_iters}")
    if n and (not np.all(np.isfinite(c)) or c.min() < 0):
        raise ValueError("costs must be finite and non-negative")
    lens: np.ndarray | None = None
    if lengths is not None:
        lens = np.asarray(lengths).ravel()
        if lens.size != n:
            raise ValueError(f"lengths has {lens.size} entries but costs has {n}")
    if capacity is not None:
        if lens is None:
            raise ValueError("capacity (tokens per micro-batch) needs lengths")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if n and lens.max() > capacity:
            bad = int(np.argmax(lens))
            raise ValueError(
                f"sample {bad} has {int(lens[bad])} tokens, more than the micro-batch capacity of "
                f"{capacity}; raise capacity or split/truncate the sample"
            )

    rng = np.random.default_rng(seed)
    rank_of, loads = _lpt(c, num_ranks, rng)
    greedy_max = float(np.bincount(rank_of, weights=c, minlength=num_ranks).max()) if n else 0.0
    lower_bound = max(float(c.sum()) / num_ranks, float(c.max())) if n else 0.0
    iters = _refine(c, rank_of, loads, max_iters, start + time_budget_s, lower_bound * (1 + tolerance))

    # Group by rank, each rank's members costliest first (stable on index for determinism).
    order = np.lexsort((np.arange(n), -c, rank_of))
    bounds = np.searchsorted(rank_of[order], np.arange(num_ranks + 1))
    order_list = order.tolist()
    cost_list = c.tolist()
    len_list = lens.astype(np.int64).tolist() if lens is not None else None
    assignment = [
        _split_micro_batches(
            order_list[bounds[r] : bounds[r + 1]], cost_list, len_list, micro_batches_per_rank, capacity
        )
        for r in range(num_ranks)
    ]
    width = max(len(mbs) for mbs in assignment)
    for mbs in assignment:
        mbs.extend([] for _ in range(width - len(mbs)))

    rank_costs = np.bincount(rank_of, weights=c, minlength=num_ranks) if n else np.zeros(num_ranks)
    return Plan(
        assignment=assignment,
        max_cost=float(rank_costs.max()),
        mean_cost=float(c.sum() / num_ranks),
        greedy_max_cost=greedy_max,
        seconds=time.perf_counter() - start,
        rank_costs=rank_costs,
        iterations=iters,
    )
