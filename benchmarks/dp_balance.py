"""Data-parallel load balance of a synthetic multimodal length mix: round-robin, equal tokens, Loong.

Each global batch holds ``--samples`` samples (default 4096) drawn, seeded, from:

- 70% single images: 256-1K tokens;
- 25% multi-image / long text: 4-8K tokens;
- 5% videos: 20-100K tokens.

Per-sample cost is ``CostModel(a=1/24576, b=1)``: the linear (MLP/projection) and quadratic
(attention) FLOP terms of a hidden-4096 transformer cross at ~24K tokens (``24*d*L`` vs ``4*L**2``),
in units of one token's linear cost. Per rank count (default 64 and 512) and batch, it reports
max/mean rank cost for:

- round-robin: sample ``i`` to rank ``i % ranks`` (the usual sharded sampler);
- equal tokens: :func:`loong.core.balance.plan` on token counts (balances tokens, not cost);
- loong: :func:`loong.core.balance.plan` on costs (default 20 ms budget);

plus the lower bound ``max(mean, costliest sample) / mean`` that no assignment of whole samples can
beat, and the planner's wall time per batch (median and max over ``--batches`` batches, after one
warm-up). Prints a table and writes JSON (command, versions, hardware, figures) to
``benchmarks/results/dp_balance_cpu_<date>.json``.

    uv run python benchmarks/dp_balance.py            # 20 batches x 4096 samples, 64 and 512 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from _env import host, versions  # benchmarks/_env.py (run as scripts from the repo root)

from loong.core.balance import CostModel, plan

RESULTS = Path(__file__).resolve().parent / "results"
COST = CostModel(a=1 / 24576, b=1.0, c=0.0)


def synthetic_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """Token counts of ``n`` samples of the 70/25/5 image / multi-image+long-text / video mix."""
    u = rng.random(n)
    images = rng.integers(256, 1024, n, endpoint=True)
    multi = rng.integers(4096, 8192, n, endpoint=True)
    video = rng.integers(20_000, 100_000, n, endpoint=True)
    return np.where(u < 0.70, images, np.where(u < 0.95, multi, video))


def _imbalance(rank_of: np.ndarray, costs: np.ndarray, ranks: int) -> float:
    loads = np.bincount(rank_of, weights=costs, minlength=ranks)
    return float(loads.max() / loads.mean())


def _rank_of(assignment: list[list[list[int]]], n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.int64)
    for r, mbs in enumerate(assignment):
        for mb in mbs:
            out[mb] = r
    return out


def run(ranks: int, samples: int, batches: int, seed: int, budget: float) -> dict:
    """Figures for one rank count over ``batches`` seeded global batches."""
    rng = np.random.default_rng(seed)
    warm = synthetic_lengths(samples, np.random.default_rng(seed + 10_000))
    plan(COST.cost(warm), ranks, time_budget_s=budget)
    rr, eq, lo, lb, greedy, secs, iters = [], [], [], [], [], [], []
    for _ in range(batches):
        lengths = synthetic_lengths(samples, rng)
        costs = COST.cost(lengths)
        rr.append(_imbalance(np.arange(samples) % ranks, costs, ranks))
        tok = plan(lengths.astype(np.float64), ranks, time_budget_s=budget)
        eq.append(_imbalance(_rank_of(tok.assignment, samples), costs, ranks))
        t0 = time.perf_counter()
        p = plan(costs, ranks, time_budget_s=budget)
        secs.append(time.perf_counter() - t0)
        lo.append(p.imbalance)
        greedy.append(p.greedy_max_cost / p.mean_cost)
        lb.append(max(p.mean_cost, float(costs.max())) / p.mean_cost)
        iters.append(p.iterations)

    def stats(xs: list[float]) -> dict:
        return {"median": round(float(np.median(xs)), 4), "max": round(float(np.max(xs)), 4)}

    return {
        "ranks": ranks,
        "samples": samples,
        "batches": batches,
        "round_robin_max_over_mean": stats(rr),
        "equal_tokens_max_over_mean": stats(eq),
        "loong_greedy_max_over_mean": stats(greedy),
        "loong_max_over_mean": stats(lo),
        "lower_bound_max_over_mean": stats(lb),
        "loong_refinement_ops": stats(iters),
        "loong_plan_ms": {
            "median": round(float(np.median(secs)) * 1e3, 2),
            "max": round(float(np.max(secs)) * 1e3, 2),
        },
    }


def main() -> None:
    """Parse arguments, run every rank count, print the table and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-ms", type=float, default=20.0, help="planner time_budget_s, in ms")
    ap.add_argument("--no-write", action="store_true", help="print only, write no JSON")
    args = ap.parse_args()

    hardware = host()
    rows = [run(r, args.samples, args.batches, args.seed, args.budget_ms / 1e3) for r in args.ranks]
    hardware["load_average_after"] = os.getloadavg()

    head = (
        f"{'ranks':>5}  {'round-robin':>11}  {'equal-tok':>9}  {'loong':>7}  {'bound':>7}  "
        f"{'plan ms (med/max)':>17}"
    )
    print(f"max/mean rank cost, median over {args.batches} batches of {args.samples} samples")
    print(head)
    for r in rows:
        print(
            f"{r['ranks']:>5}  {r['round_robin_max_over_mean']['median']:>11.3f}  "
            f"{r['equal_tokens_max_over_mean']['median']:>9.3f}  {r['loong_max_over_mean']['median']:>7.4f}  "
            f"{r['lower_bound_max_over_mean']['median']:>7.4f}  "
            f"{r['loong_plan_ms']['median']:>8.2f}/{r['loong_plan_ms']['max']:<8.2f}"
        )
    if args.no_write:
        return
    result = {
        "benchmark": "dp_balance",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": "python benchmarks/dp_balance.py " + " ".join(sys.argv[1:]),
        "mix": {
            "single_image": [0.70, 256, 1024],
            "multi_image_long_text": [0.25, 4096, 8192],
            "video": [0.05, 20_000, 100_000],
        },
        "cost_model": {"a": COST.a, "b": COST.b, "c": COST.c},
        "planner": {"time_budget_s": args.budget_ms / 1e3, "micro_batches_per_rank": 1, "seed": 0},
        "versions": versions(["loong-core", "numpy"]),
        "hardware": hardware,
        "figures": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"dp_balance_cpu_{time.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
