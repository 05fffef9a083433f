"""RMSNorm forward and backward, each against an elementwise op that moves the same bytes, over the kernel's tilings.

Issue 26 asks for RMSNorm forward + backward at hidden 2048 at >= 85% of copy bandwidth (57% measured, with the
bandwidth of a 2 GiB copy as the ceiling). At 16K rows x 2048 a tensor is 64 MiB, so each launch is short and its
ramp-up and tail could weigh more than on a 2 GiB copy. This script separates what the kernel loses from what any
kernel of that size loses:

- ``fwd``: ``rms_norm`` forward (read x, write y), beside ``y.copy_(x)`` of the same tensors;
- ``bwd``: forward + backward less forward (read x and dy, write dx; plus the weight gradient's per-program partial
  sums and their reduction), beside ``torch.add(x, dy, out=dx)`` (read two, write one);
- ``fwd+bwd``: ``torch.autograd.grad`` through it, as ``benchmarks/kernels.py`` times it (the issue's figure).

Every time is CUDA-graph replay (``triton.testing.do_bench_cudagraph``: device time, no launch overhead). Per shape
(``--shapes``; the default adds Qwen3's q/k norms, 262144 rows of 128) it times, in one run: the backward as it was
before 2026-12-04 (``before``: the weight gradient reduced over the rows of every tile, at most 16 rows a tile),
the shipped knobs, then a sweep of the forward's elements per program (``norm.FWD_ELEMS``) and of the backward's
weight-gradient accumulation (``norm.BWD_DW_ACCUMULATE``), programs per SM (``norm.BWD_PROGRAMS_PER_SM``) and
(software-pipelining stages, tile elements) (``norm.BWD_TILING``). Prints each figure and writes JSON (command,
versions, hardware, every figure).

    python benchmarks/rms_norm_sweep.py --out benchmarks/results/rms_norm_sweep_<gpu>_<date>.json
    python benchmarks/rms_norm_sweep.py --shapes 16384x2048 --quick
    python benchmarks/rms_norm_sweep.py --compare-only          # before vs shipped, both default shapes
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from _env import host, versions  # benchmarks/_env.py (run as scripts from the repo root)

import loong.kernels.norm as norm
from loong.kernels import rms_norm

RESULTS = Path(__file__).parent / "results"


def bench(fn, rep_ms: int) -> float:
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def measure(rows: int, hidden: int, rep_ms: int) -> dict:
    """Times of the current knobs: forward, backward, both; bytes counted as the minimal traffic."""
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)

    def fwd() -> None:
        with torch.no_grad():
            rms_norm(x, w, 1e-6, backend="triton")

    def both() -> None:
        torch.autograd.grad(rms_norm(x, w, 1e-6, backend="triton"), (x, w), dy)

    # the backward alone as the difference: autograd replays a graph built outside the capture on the forward's
    # stream, which invalidates a capture on another stream
    t = {"fwd_ms": bench(fwd, rep_ms), "fwd_bwd_ms": bench(both, rep_ms)}
    t["bwd_ms"] = t["fwd_bwd_ms"] - t["fwd_ms"]
    return {k: round(v, 4) for k, v in t.items()}


def ceilings(rows: int, hidden: int, rep_ms: int, copy_gbs: float) -> dict:
    """Elementwise ops of the same tensors and traffic: what any kernel of this size reaches."""
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    dy, out = torch.randn_like(x), torch.empty_like(x)
    tensor = rows * hidden * 2
    copy_ms = bench(lambda: out.copy_(x), rep_ms)
    add_ms = bench(lambda: torch.add(x, dy, out=out), rep_ms)
    return {"copy_same_size_ms": round(copy_ms, 4), "add_same_size_ms": round(add_ms, 4),
            "copy_same_size_frac_of_copy": round(gbps(2 * tensor, copy_ms) / copy_gbs, 3),
            "add_same_size_frac_of_copy": round(gbps(3 * tensor, add_ms) / copy_gbs, 3),
            "copy_plus_add_frac_of_copy": round(gbps(5 * tensor, copy_ms + add_ms) / copy_gbs, 3)}


KNOBS = ("FWD_ELEMS", "BWD_PROGRAMS_PER_SM", "BWD_TILING", "BWD_MAX_ROWS", "BWD_DW_ACCUMULATE")
#: the backward as it shipped before 2026-12-04: the weight gradient reduced over rows every tile, 16 rows a tile
BEFORE = {"BWD_DW_ACCUMULATE": "row", "BWD_MAX_ROWS": 16}


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy (read + write), the ceiling of issue 26's figure."""
    from triton.testing import do_bench

    big = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16)
    return gbps(2 * big.numel() * 2, do_bench(lambda: big.clone(), warmup=25, rep=100))


def frac(nbytes: int, ms: float, copy_gbs: float) -> float:
    return round(gbps(nbytes, ms) / copy_gbs, 3)


def sweep_shape(rows: int, h: int, args: argparse.Namespace, copy_gbs: float, shipped: dict) -> dict:
    tensor = rows * h * 2
    shape: dict = {"rows": rows, "hidden": h, **ceilings(rows, h, args.rep_ms, copy_gbs)}
    print(f"\n{rows}x{h}: same-size copy {shape['copy_same_size_frac_of_copy']:.0%}, add "
          f"{shape['add_same_size_frac_of_copy']:.0%}, copy+add {shape['copy_plus_add_frac_of_copy']:.0%} "
          "of the 2 GiB copy")

    def timed(label: str, **knobs: object) -> dict:
        for k, v in {**shipped, **knobs}.items():
            setattr(norm, k, v)
        try:
            t = measure(rows, h, args.rep_ms)
        except Exception as exc:  # a tiling Triton cannot compile (registers, shared memory): keep the reason
            print(f"  {label}: {str(exc).splitlines()[0][:120]}")
            return {**knobs, "error": str(exc).splitlines()[0]}
        finally:
            for k, v in shipped.items():
                setattr(norm, k, v)
        r = {**{k: list(v) if isinstance(v, tuple) else v for k, v in knobs.items()}, **t,
             "fwd_frac_of_copy": frac(2 * tensor, t["fwd_ms"], copy_gbs),
             "bwd_frac_of_copy": frac(3 * tensor, t["bwd_ms"], copy_gbs),
             "fwd_bwd_frac_of_copy": frac(5 * tensor, t["fwd_bwd_ms"], copy_gbs)}
        print(f"  {label:<44} fwd {t['fwd_ms'] * 1e3:6.1f} us {r['fwd_frac_of_copy']:4.0%}  bwd "
              f"{t['bwd_ms'] * 1e3:6.1f} us {r['bwd_frac_of_copy']:4.0%}  both {t['fwd_bwd_ms'] * 1e3:6.1f} us "
              f"{r['fwd_bwd_frac_of_copy']:4.0%}")
        return r

    shape["before"] = timed("before (row-reduced dw, <= 16 rows a tile)", **BEFORE)
    shape["shipped"] = timed("shipped")
    if args.compare_only:
        return shape
    shape["fwd_sweep"] = [timed(f"fwd elems {e}", FWD_ELEMS=e) for e in (2048, 4096, 8192, 16384)]
    per_sm = (1, 2) if args.quick else (1, 2, 4)
    tiles = (8192, 16384) if args.quick else (8192, 16384, 32768)
    shape["bwd_sweep"] = [timed(f"bwd dw {dw} {ps}/SM stages {st} elems {e}", BWD_DW_ACCUMULATE=dw,
                                BWD_PROGRAMS_PER_SM=ps, BWD_TILING=(st, e))
                          for dw, ps, st, e in itertools.product(("tile", "row"), per_sm, (1, 3), tiles)]
    ok = [r for r in shape["bwd_sweep"] if "bwd_ms" in r]
    best_f = min((r for r in shape["fwd_sweep"] if "fwd_ms" in r), key=lambda r: r["fwd_ms"])
    best_b = min(ok, key=lambda r: r["bwd_ms"])
    shape.update(best_fwd=best_f, best_bwd=best_b, best_fwd_plus_bwd_frac_of_copy=frac(
        5 * tensor, best_f["fwd_ms"] + best_b["bwd_ms"], copy_gbs))
    print(f"  best fwd + best bwd: {shape['best_fwd_plus_bwd_frac_of_copy']:.0%} of copy")
    return shape


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["16384x2048", "262144x128"],
                   help="ROWSxHIDDEN; 262144x128 is a q/k norm over 128-wide heads (16K tokens x 16 heads)")
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--quick", action="store_true", help="a smaller grid (programs per SM 1 and 2, tiles 8K/16K)")
    p.add_argument("--compare-only", action="store_true", help="only the backward before 2026-12-04 and the shipped")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("rms_norm_sweep.py times CUDA kernels; no CUDA device here")
    t0 = time.time()
    copy_gbs = copy_bandwidth()
    print(f"device copy bandwidth (2 GiB): {copy_gbs:,.0f} GB/s")
    shipped = {k: getattr(norm, k) for k in KNOBS}
    out: dict = {"benchmark": "rms_norm_sweep", "date": time.strftime("%Y-%m-%d"),
                 "command": "python " + " ".join(sys.argv), "args": vars(args),
                 "versions": versions(["torch", "triton", "loong-kernels"]), "hardware": host(),
                 "copy_bandwidth_gbs": round(copy_gbs, 1), "shipped_knobs": {k: str(v) for k, v in shipped.items()},
                 "bytes_counted": "fwd 2, bwd 3, fwd+bwd 5 tensors of rows x hidden bf16 (dw traffic not counted)",
                 "shapes": []}
    for spec in args.shapes:
        rows, h = (int(v) for v in spec.lower().split("x"))
        out["shapes"].append(sweep_shape(rows, h, args, copy_gbs, shipped))
    out["wall_s"] = round(time.time() - t0)
    path = Path(args.out) if args.out else RESULTS / f"rms_norm_sweep_{time.strftime('%Y%m%d')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
