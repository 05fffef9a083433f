"""DeepSeek sparse attention (DSA) kernels against the eager PyTorch references, on one GPU.

At DeepSeek-V3.2's shapes (batch 1, H = 128 heads of D_qk = 576 / v_dim = 512, top-k 2048; indexer 64 heads
of 128) and sequence lengths 8K, 32K and 64K, it times:

- ``sparse_mla_attention``: forward, and forward + backward (gradients of q and kv), with peak memory;
- ``indexer_topk``: the lightning indexer's scores and top-k selection (forward only; no gradient).

Each against its ``*_reference``; a reference that runs out of memory is recorded as "OOM". Prints a table
and writes JSON (command, versions, hardware, every figure) to ``benchmarks/results/dsa_<gpu>_<date>.json``.

    python benchmarks/dsa.py                  # 8K, 32K, 64K (a few minutes on an H200)
    python benchmarks/dsa.py --quick          # 8K only, fewer repetitions
    python benchmarks/dsa.py --seqlens 4096 8192 --heads 16
    TRITON_INTERPRET=1 python benchmarks/dsa.py --dry-run   # CPU: checks the script, times nothing useful

FLOPs are counted on the selected-token work only (what a sparse kernel must do):

- forward: ``2 * S * K * H * (D_qk + v_dim)`` (the ``q.k`` products over D_qk channels, ``p @ v`` over
  v_dim), i.e. 4.67 TFLOP at S = 8K;
- backward: ``2.5 x`` the forward (``q.k`` recomputed, ``dO.v``, ``dq``, ``dk``, ``dv``: 5 GEMM-shaped
  products against the forward's 2, with ``dq``/``dk`` over D_qk and ``dO.v``/``dv`` over v_dim);
  the forward + backward column counts ``3.5 x`` the forward, and backward-only TFLOP/s is derived from
  ``fwd_bwd_ms - fwd_ms``;
- indexer: ``2 * S * (S + 1) / 2 * H_I * D_I`` for the causal scores (the top-k itself is not counted).

Targets from the issue: at 8K the fused forward + backward at least 5x the eager reference, and the
backward at least 150 TFLOP/s.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from _env import host, versions  # benchmarks/_env.py (run as scripts from the repo root)

RESULTS = Path(__file__).parent / "results"


def _config(text: str | None, keys: tuple[str, ...]) -> dict[str, int] | None:
    """``"64,64,8,2"`` -> ``{keys[0]: 64, ...}`` (a kernel block configuration override)."""
    if not text:
        return None
    values = [int(v) for v in text.split(",")]
    if len(values) != len(keys):
        raise argparse.ArgumentTypeError(f"expected {len(keys)} comma-separated integers ({','.join(keys)}), "
                                         f"got {text!r}")
    return dict(zip(keys, values, strict=True))


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dev = torch.device("cpu" if args.dry_run else "cuda")
        self.rows: list[dict] = []

    def time_ms(self, fn: Callable[[], object]) -> float:
        """Median wall time per call in ms (CUDA events; synchronising), after warm-up."""
        if self.dev.type != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=self.args.warmup_ms, rep=self.args.rep_ms, return_mode="median"))

    def reset(self) -> None:
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        return round(torch.cuda.max_memory_allocated() / 2**30, 2) if self.dev.type == "cuda" else None

    def measure(self, row: dict, name: str, fn: Callable[[], object]) -> None:
        """``row[name + '_ms']`` and ``row[name + '_peak_gib']``, or ``"OOM"`` / an error string."""
        self.reset()
        try:
            row[f"{name}_ms"] = self.time_ms(fn)
            row[f"{name}_peak_gib"] = self.peak_gib()
        except torch.cuda.OutOfMemoryError:
            row[f"{name}_ms"] = "OOM"
        except Exception as e:  # noqa: BLE001 - record it and go on with the other measurements
            row[f"{name}_ms"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if self.args.verbose:
                traceback.print_exc()
        self.reset()


@contextlib.contextmanager
def _backward(split: bool | None) -> Iterator[None]:
    """The sparse attention's backward inside: the split one (dq pass, then dkv pass), the fused one, or (None)
    the module's default."""
    from loong.kernels.dsa import attention

    default = attention.BWD_SPLIT
    attention.BWD_SPLIT = default if split is None else split  # read when the backward runs
    try:
        yield
    finally:
        attention.BWD_SPLIT = default


def _split_backward_error(fn, q, kv, idx, dout, scale: float, v: int) -> list[float]:  # noqa: ANN001
    """Relative L2 difference of (dq, dkv) between the fused and the split backward, summed slice by slice over
    the sequence so that no fp32 copy of a 64K-token dq exists; nothing is kept for the timings."""
    grads = []
    for split in (False, True):
        with _backward(split):
            out, _ = fn(q, kv, idx, softmax_scale=scale, v_dim=v)
            grads.append(torch.autograd.grad(out, (q, kv), dout))
        del out
    errs = []
    for fused, split in zip(*grads, strict=True):
        diff = ref = 0.0
        for f, s_ in zip(fused.split(4096, dim=1), split.split(4096, dim=1), strict=True):
            diff += float((s_.float() - f.float()).square().sum())
            ref += float(f.float().square().sum())
        errs.append((diff / max(ref, 1e-30)) ** 0.5)
    del grads
    return errs


def attention_inputs(s: int, h: int, d: int, v: int, k: int, index_heads: int, index_dim: int, dtype: torch.dtype,
                     dev: str, backend: str) -> tuple[torch.Tensor, ...]:
    """Seeded ``q [1, s, h, d]``, ``kv [1, s, d]`` (both requiring grad), top-``k`` indices and ``dout [1, s, h, v]``.

    Realistic indices: the indexer's own (causal, -1 padded on the first K rows) on random indexer inputs.
    """
    from loong.kernels.dsa import indexer_topk

    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, s, h, d, device=dev, generator=g).to(dtype).requires_grad_()
    kv = torch.randn(1, s, d, device=dev, generator=g).to(dtype).requires_grad_()
    iq = torch.randn(1, s, index_heads, index_dim, device=dev, generator=g).to(dtype)
    ik = torch.randn(1, s, index_dim, device=dev, generator=g).to(dtype)
    iw = torch.randn(1, s, index_heads, device=dev, generator=g) * index_heads ** -0.5
    with torch.no_grad():
        idx = indexer_topk(iq, ik, iw, k, backend=backend)
    dout = torch.randn(1, s, h, v, device=dev, generator=g).to(dtype)
    return q, kv, idx, dout


def bench_attention(b: Bench, s: int) -> None:
    from loong.kernels.dsa import sparse_mla_attention, sparse_mla_attention_reference

    a = b.args
    h, d, v, k = a.heads, a.d_qk, a.v_dim, a.topk
    q, kv, idx, dout = attention_inputs(s, h, d, v, k, a.index_heads, a.index_dim, a.dtype, b.dev, b.backend)
    scale = d ** -0.5
    # The issue's count, S * K pairs: the kernel computes every slot (the first K rows' -1 slots masked).
    fwd_flops = 2.0 * s * k * h * (d + v)
    n_valid = int((idx >= 0).sum())
    loong = lambda *x, **kw: sparse_mla_attention(*x, **kw, backend=b.backend)  # noqa: E731
    impls = [("loong", loong, None), ("loong-fused", loong, False), ("eager", sparse_mla_attention_reference, None)]
    fused_err = _split_backward_error(loong, q, kv, idx, dout, scale, v) if a.compare_fused else None
    for impl, fn, split in impls:
        if (impl == "eager" and not a.reference) or (impl == "loong-fused" and not a.compare_fused):
            continue
        row = {"op": "sparse_mla_attention", "seqlen": s, "impl": impl, "heads": h, "d_qk": d, "v_dim": v,
               "topk": k, "valid_pairs": n_valid, "dtype": str(a.dtype), "fwd_tflop": fwd_flops / 1e12}

        def fwd(fn=fn):
            with torch.no_grad():
                return fn(q, kv, idx, softmax_scale=scale, v_dim=v)

        def fwd_bwd(fn=fn, split=split):
            with _backward(split):
                out, _ = fn(q, kv, idx, softmax_scale=scale, v_dim=v)
                torch.autograd.backward(out, dout, inputs=[q, kv])
            q.grad = kv.grad = None

        if impl == "loong-fused":
            row["rel_err_vs_split_bwd"] = fused_err

        b.measure(row, "fwd", fwd)
        b.measure(row, "fwd_bwd", fwd_bwd)
        if isinstance(row.get("fwd_ms"), float):
            row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
        if isinstance(row.get("fwd_bwd_ms"), float):
            row["fwd_bwd_tflops"] = 3.5 * fwd_flops / row["fwd_bwd_ms"] / 1e9
            if isinstance(row.get("fwd_ms"), float) and row["fwd_bwd_ms"] > row["fwd_ms"]:
                row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
                row["bwd_tflops"] = 2.5 * fwd_flops / row["bwd_ms"] / 1e9
        b.rows.append(row)
        _print(row)


def bench_indexer(b: Bench, s: int) -> None:
    from loong.kernels.dsa import indexer_topk, indexer_topk_reference

    a = b.args
    g = torch.Generator(device=b.dev).manual_seed(1)
    q = torch.randn(1, s, a.index_heads, a.index_dim, device=b.dev, generator=g).to(a.dtype)
    k = torch.randn(1, s, a.index_dim, device=b.dev, generator=g).to(a.dtype)
    w = torch.randn(1, s, a.index_heads, device=b.dev, generator=g) * a.index_heads ** -0.5
    flops = 2.0 * s * (s + 1) / 2 * a.index_heads * a.index_dim
    for impl, fn in (("loong", lambda: indexer_topk(q, k, w, a.topk, backend=b.backend)),
                     ("eager", lambda: indexer_topk_reference(q, k, w, a.topk))):
        if impl == "eager" and not a.reference:
            continue
        row = {"op": "indexer_topk", "seqlen": s, "impl": impl, "heads": a.index_heads, "d": a.index_dim,
               "topk": a.topk, "dtype": str(a.dtype), "fwd_tflop": flops / 1e12}
        b.measure(row, "fwd", fn)
        if isinstance(row.get("fwd_ms"), float):
            row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
        b.rows.append(row)
        _print(row)


def _fmt(x: object, spec: str) -> str:
    return format(x, spec) if isinstance(x, float) else str(x if x is not None else "-")


def _print(r: dict) -> None:
    print(f"  {r['op']:<22}{r['seqlen']:>7} {r['impl']:<7}{_fmt(r.get('fwd_ms'), '.2f'):>10}"
          f"{_fmt(r.get('fwd_tflops'), '.0f'):>7}{_fmt(r.get('fwd_bwd_ms'), '.2f'):>10}"
          f"{_fmt(r.get('bwd_tflops'), '.0f'):>8}{_fmt(r.get('fwd_bwd_peak_gib', r.get('fwd_peak_gib')), '.2f'):>9}",
          flush=True)


def summary(b: Bench) -> dict:
    """Speed-up over eager (forward, forward + backward) and the backward's TFLOP/s, per sequence length."""
    out: dict = {}
    by = {(r["op"], r["seqlen"], r["impl"]): r for r in b.rows}
    for (op, s, impl), r in by.items():
        if not impl.startswith("loong"):
            continue
        entry: dict = {k: round(r[k], 3) for k in ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "bwd_tflops")
                       if isinstance(r.get(k), float)}
        eager = by.get((op, s, "eager"))
        for key in ("fwd_ms", "fwd_bwd_ms"):
            if eager is None or key not in r:
                continue
            if isinstance(eager.get(key), float) and isinstance(r.get(key), float):
                entry[f"speedup_{key[:-3]}"] = round(eager[key] / r[key], 2)
            elif eager.get(key) == "OOM":
                entry[f"speedup_{key[:-3]}"] = "eager OOM"
        out.setdefault(op, {})[str(s) if impl == "loong" else f"{s} {impl}"] = entry
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768, 65536])
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--d-qk", type=int, default=576)
    p.add_argument("--v-dim", type=int, default=512)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--index-heads", type=int, default=64)
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--only", nargs="+", choices=["attention", "indexer"], default=["attention", "indexer"])
    p.add_argument("--no-reference", dest="reference", action="store_false", help="skip the eager columns")
    p.add_argument("--quick", action="store_true", help="8K only, shorter timing loops")
    p.add_argument("--fwd-config", help="attention forward blocks BLOCK_H,BLOCK_N,num_warps,num_stages")
    p.add_argument("--bwd-config", help="attention backward blocks BLOCK_H,BLOCK_N,num_warps,num_stages")
    p.add_argument("--indexer-config", help="indexer BLOCK_N,num_warps,per_sm")
    p.add_argument("--compare-fused", action="store_true",
                   help="also time the fused one-kernel backward (the default is the two-pass split one)")
    p.add_argument("--dq-config", help="split backward's dq pass BLOCK_H,BLOCK_N,num_warps,num_stages")
    p.add_argument("--dkv-config", help="split backward's dkv pass BLOCK_H,BLOCK_N,num_warps,num_stages")
    p.add_argument("--warmup-ms", type=float, default=100)
    p.add_argument("--rep-ms", type=float, default=500)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU through Triton's interpreter")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default: results/dsa_<gpu>_<date>.json)")
    args = p.parse_args()
    keys = ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages")
    try:
        fwd_cfg, bwd_cfg = _config(args.fwd_config, keys), _config(args.bwd_config, keys)
        dq_cfg, dkv_cfg = _config(args.dq_config, keys), _config(args.dkv_config, keys)
        idx_cfg = _config(args.indexer_config, ("BLOCK_N", "num_warps", "per_sm"))
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.quick:
        args.seqlens, args.warmup_ms, args.rep_ms = [8192], 25, 100
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        args.seqlens, args.heads, args.d_qk, args.v_dim, args.topk = [24], 3, 40, 32, 8
        args.index_heads, args.index_dim = 4, 16
    elif not torch.cuda.is_available():
        sys.exit("dsa.py needs a CUDA GPU (or --dry-run)")
    from loong.kernels.dsa import attention, indexer

    if fwd_cfg:
        attention.FWD_CONFIG = fwd_cfg
    if bwd_cfg:
        attention.BWD_CONFIG = bwd_cfg
    if dq_cfg:
        attention.DQ_CONFIG = dq_cfg
    if dkv_cfg:
        attention.DKV_CONFIG = dkv_cfg
    if idx_cfg:
        indexer.INDEXER_CONFIG = idx_cfg
    b = Bench(args)
    b.backend = "triton"  # the Loong column must be the kernel, never a silent fallback
    hw = host()
    out = Path(args.out) if args.out else RESULTS / (
        f"dsa_{(hw.get('gpu') or 'cpu').split()[-1].lower()}_{time.strftime('%Y%m%d')}.json")
    print(f"  {'op':<22}{'S':>7} {'impl':<7}{'fwd ms':>10}{'TF/s':>7}{'f+b ms':>10}{'bwd TF/s':>8}{'peak GiB':>9}")
    t0 = time.time()
    for s in args.seqlens:
        for op in args.only:
            (bench_attention if op == "attention" else bench_indexer)(b, s)
            result = {"benchmark": "dsa", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "command": " ".join(["python benchmarks/dsa.py", *sys.argv[1:]]),
                      "args": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in vars(args).items()},
                      "versions": versions(["torch", "triton", "loong-kernels"]), "hardware": hw,
                      "configs": {"attention_fwd": attention.FWD_CONFIG, "attention_bwd": attention.BWD_CONFIG,
                                  "attention_bwd_split_dq": attention.DQ_CONFIG,
                                  "attention_bwd_split_dkv": attention.DKV_CONFIG,
                                  "indexer": indexer.INDEXER_CONFIG},
                      "flops_counted": "fwd 2*S*K*H*(D_qk+v_dim); bwd 2.5x fwd; fwd+bwd 3.5x fwd; "
                                       "indexer 2*S*(S+1)/2*H_I*D_I",
                      "timing": "median of event-timed calls (triton.testing.do_bench)",
                      "wall_s": round(time.time() - t0), "summary": summary(b), "rows": b.rows}
            if not args.dry_run or args.out:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=2) + "\n")  # after every section: a timeout keeps the rest
    print(json.dumps(summary(b), indent=1))
    if b.rows and (not args.dry_run or args.out):
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
