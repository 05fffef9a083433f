"""Loong's Triton kernels beside eager PyTorch, torch.compile and Liger-Kernel, on one GPU.

For LLM shapes (16K tokens; hidden 2048/4096/8192; vocabularies 128256 and 151936; bf16) it times
forward and forward+backward of RMSNorm (plain and with the fused residual add), SwiGLU, RoPE, the fused
linear + cross-entropy (with its peak memory) and the FP8 quantisers, and measures the card's
device-to-device copy bandwidth as the ceiling for the memory-bound kernels. Prints a table and writes
JSON (command, versions, hardware, every figure) to ``benchmarks/results/``.

    python benchmarks/kernels.py                       # everything (about 5 minutes on an H200)
    python benchmarks/kernels.py --only rms_norm swiglu --no-compile
    TRITON_INTERPRET=1 python benchmarks/kernels.py --dry-run   # CPU: checks the script, times nothing useful

"Effective GB/s" counts the bytes a fused kernel must move at least (each input read once, each
output written once, forward plus backward), divided by the measured time; the same count is used for
every column, so the columns compare times. Liger-Kernel is imported if installed (else that column
is skipped); its functions take their own layouts (separate gate/up tensors, HF's [b, h, s, d] RoPE),
which are used as Liger documents them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from _env import host, versions  # benchmarks/_env.py (run as scripts from the repo root)

RESULTS = Path(__file__).parent / "results"
OPS = ("rms_norm", "rms_norm_residual", "swiglu", "rope", "cross_entropy", "fp8", "tune")
FFN = {2048: 8192, 4096: 14336, 8192: 28672}  # LLaMA 3.2 1B, 3.1 8B, 3.1 70B


def _liger():
    try:
        from liger_kernel.transformers import functional as lf
    except Exception as e:  # noqa: BLE001 - any import failure means "no Liger column"
        print(f"liger_kernel not importable ({type(e).__name__}: {e}); the Liger column is skipped")
        return None
    return lf


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dev = torch.device("cpu" if args.dry_run else "cuda")
        self.rows: list[dict] = []
        self.copy_gbs: float | None = None
        self.liger = None if args.dry_run else _liger()
        self.compiled: dict[str, Callable] = {}
        self.tuned: dict = {}

    # ------------------------------------------------------------------------------------------ timing
    def time_ms(self, fn: Callable[[], object]) -> float:
        """Median of event-timed calls, L2 flushed before each (``triton.testing.do_bench``): includes
        whatever the host needs to launch the work when that is longer than the work itself."""
        if self.args.dry_run:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=self.args.warmup_ms, rep=self.args.rep_ms, return_mode="median"))

    def graph_ms(self, fn: Callable[[], object]) -> float | None:
        """Device time per call: many calls captured in one CUDA graph and replayed, so that Python, autograd
        and launch overhead (about 0.5 ms per forward+backward here, for every column) drop out, as they do in
        training where the host runs ahead of the GPU."""
        if self.args.dry_run:
            return None
        from triton.testing import do_bench_cudagraph

        return float(do_bench_cudagraph(fn, rep=self.args.graph_rep_ms, return_mode="median"))

    def measure_copy(self) -> None:
        n = (1 << 30) if not self.args.dry_run else (1 << 16)  # 2 GiB of bf16, far beyond the 60 MB L2
        x = torch.randn(n, device=self.dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        ms = self.time_ms(lambda: y.copy_(x))
        self.copy_gbs = 2 * x.numel() * x.element_size() / ms / 1e6
        print(f"device copy bandwidth: {self.copy_gbs:,.0f} GB/s (read + write of {x.numel() * 2 / 2**30:.0f} GiB)")

    def compiled_fn(self, name: str, fn: Callable) -> Callable:
        if name not in self.compiled:
            self.compiled[name] = torch.compile(fn)
        return self.compiled[name]

    # ------------------------------------------------------------------------------------------ record
    def run(self, op: str, shape: str, impl: str, make: Callable[[], tuple], nbytes: int | None,
            flops: float | None = None, memory: bool = False, backward: bool = True, graph: bool = True) -> None:
        """``make()`` returns ``(forward_fn, leaves, grads_out)``; times forward, forward+backward, memory.

        ``fwd_ms``/``fwd_bwd_ms`` are device times from CUDA-graph replay when ``graph`` (the memory-bound
        kernels), else event-timed calls; ``*_launch`` are always event-timed calls."""
        row: dict = {"op": op, "shape": shape, "impl": impl}
        try:
            fwd, leaves, grads = make()

            def fwd_ng() -> object:
                with torch.no_grad():
                    return fwd()

            def step() -> None:
                out = fwd()
                outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
                torch.autograd.grad(outs[: len(grads)], leaves, grads[: len(outs)], allow_unused=True)

            row["fwd_ms"] = row["fwd_ms_launch"] = self.time_ms(fwd_ng)
            if graph:
                try:
                    row["fwd_ms"] = self.graph_ms(fwd_ng) or row["fwd_ms"]
                except Exception as e:  # noqa: BLE001
                    row["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            if backward:
                if memory and not self.args.dry_run:
                    gc.collect()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    step()
                    torch.cuda.synchronize()
                    row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                    row["peak_over_inputs_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
                row["fwd_bwd_ms"] = row["fwd_bwd_ms_launch"] = self.time_ms(step)
                if graph and "graph_error" not in row:
                    try:
                        row["fwd_bwd_ms"] = self.graph_ms(step) or row["fwd_bwd_ms"]
                    except Exception as e:  # noqa: BLE001
                        row["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            t = row.get("fwd_bwd_ms", row["fwd_ms"])
            if nbytes is not None:
                row["bytes"] = nbytes
                row["gbs"] = nbytes / t / 1e6
                if self.copy_gbs:
                    row["frac_copy"] = row["gbs"] / self.copy_gbs
            if flops is not None:
                row["tflops"] = flops / t / 1e9
        except Exception as e:  # noqa: BLE001 - one failing column must not lose the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if self.args.verbose:
                traceback.print_exc()
        finally:
            gc.collect()
            if not self.args.dry_run:
                torch.cuda.empty_cache()
        self.rows.append(row)
        self._print(row)

    @staticmethod
    def _print(r: dict) -> None:
        if "error" in r:
            print(f"  {r['op']:<18}{r['shape']:<26}{r['impl']:<9} failed: {r['error']}")
            return
        fb = f"{r['fwd_bwd_ms']:9.3f}" if "fwd_bwd_ms" in r else f"{'-':>9}"
        gbs = f"{r['gbs']:8,.0f}" if "gbs" in r else f"{'-':>8}"
        frac = f"{r['frac_copy']:6.0%}" if "frac_copy" in r else f"{'-':>6}"
        extra = f"  {r['tflops']:6.0f} TFLOP/s" if "tflops" in r else ""
        extra += f"  peak {r['peak_gib']:6.2f} GiB" if "peak_gib" in r else ""
        print(f"  {r['op']:<18}{r['shape']:<26}{r['impl']:<9}{r['fwd_ms']:9.3f}{fb}{gbs}{frac}{extra}")

    # ------------------------------------------------------------------------------------------ inputs
    def randn(self, *shape: int, grad: bool = False, scale: float = 1.0) -> torch.Tensor:
        t = (scale * torch.randn(*shape, device=self.dev, dtype=torch.float32)).to(torch.bfloat16)
        return t.requires_grad_(grad)


def bench_rms(b: Bench, residual: bool) -> None:
    from loong.kernels import rms_norm, rms_norm_reference

    op = "rms_norm_residual" if residual else "rms_norm"
    n = b.args.tokens
    for h in b.args.hidden:
        e = 2
        nbytes = (8 if residual else 5) * n * h * e  # fwd x(,r) -> y(,h); bwd dy(,dh), x|h -> dx
        shape = f"{n}x{h}"

        def make(fn, name, h=h):
            def inner():
                x = b.randn(n, h, grad=True)
                w = (1 + 0.1 * torch.randn(h, device=b.dev)).to(torch.bfloat16).requires_grad_()
                r = b.randn(n, h, grad=True) if residual else None
                grads = [b.randn(n, h)] + ([b.randn(n, h)] if residual else [])
                leaves = [x, w] + ([r] if residual else [])
                if name == "liger":
                    f = (lambda: fn(x, r, w, 1e-6)) if residual else (lambda: fn(x, w, 1e-6))
                else:
                    f = lambda: fn(x, w, 1e-6, r)  # noqa: E731
                return f, leaves, grads
            return inner

        b.run(op, shape, "loong", make(lambda *a: rms_norm(*a, backend=b.backend), "loong"), nbytes)
        b.run(op, shape, "eager", make(rms_norm_reference, "eager"), nbytes)
        if b.args.compile:
            b.run(op, shape, "compile", make(b.compiled_fn(op, rms_norm_reference), "compile"), nbytes)
        if b.liger is not None:
            fn = b.liger.liger_fused_add_rms_norm if residual else b.liger.liger_rms_norm
            b.run(op, shape, "liger", make(fn, "liger"), nbytes)


def bench_swiglu(b: Bench) -> None:
    from loong.kernels import swiglu, swiglu_reference

    n = b.args.tokens
    for h in b.args.hidden:
        f = FFN.get(h, 4 * h) if not b.args.dry_run else 96
        nbytes = 8 * n * f * 2  # fwd: 2F in, F out; bwd: F + 2F in, 2F out
        shape = f"{n}x2*{f}"

        def make(fn, f=f):
            def inner():
                gu = b.randn(n, 2 * f, grad=True)
                return (lambda: fn(gu)), [gu], [b.randn(n, f)]
            return inner

        b.run("swiglu", shape, "loong", make(lambda t: swiglu(t, backend=b.backend)), nbytes)
        b.run("swiglu", shape, "eager", make(swiglu_reference), nbytes)
        if b.args.compile:
            b.run("swiglu", shape, "compile", make(b.compiled_fn("swiglu", swiglu_reference)), nbytes)
        if b.liger is not None:
            def liger_make(f=f):
                gate, up = b.randn(n, f, grad=True), b.randn(n, f, grad=True)  # Liger takes them apart
                return (lambda: b.liger.liger_swiglu(gate, up)), [gate, up], [b.randn(n, f)]
            b.run("swiglu", shape, "liger", liger_make, nbytes)


def bench_rope(b: Bench) -> None:
    from loong.kernels import apply_rope, apply_rope_reference, rope_cos_sin, rope_inv_freq

    d = 128 if not b.args.dry_run else 16
    batch = 4 if b.args.tokens % 4 == 0 else 1
    s = b.args.tokens // batch
    inv = rope_inv_freq(d, 500000.0, llama3={}, device=b.dev)
    cos, sin = rope_cos_sin(torch.arange(s, device=b.dev), inv)
    for h in b.args.hidden:
        hq, hk = max(1, h // d), 8
        nbytes = 4 * s * batch * (hq + hk) * d * 2  # q and k read and written, forward and backward
        shape = f"{s}x{batch}x({hq}+{hk})x{d}"

        def make(fn, hq=hq, hk=hk):
            def inner():
                q, k = b.randn(s, batch, hq, d, grad=True), b.randn(s, batch, hk, d, grad=True)
                return (lambda: fn(q, k, cos, sin)), [q, k], [b.randn(s, batch, hq, d), b.randn(s, batch, hk, d)]
            return inner

        b.run("rope", shape, "loong", make(lambda *a: apply_rope(*a, backend=b.backend)), nbytes)
        b.run("rope", shape, "eager", make(apply_rope_reference), nbytes)
        if b.args.compile:
            b.run("rope", shape, "compile", make(b.compiled_fn("rope", apply_rope_reference)), nbytes)
        if b.liger is not None:
            def liger_make(hq=hq, hk=hk):
                # Liger's layout: HF [b, h, s, d] views of [b, s, h, d] storage, full-width cos/sin
                qp, kp = b.randn(batch, s, hq, d, grad=True), b.randn(batch, s, hk, d, grad=True)
                cf, sf = (torch.cat((t, t), -1)[None].to(torch.bfloat16) for t in (cos, sin))
                gq, gk = b.randn(batch, s, hq, d).transpose(1, 2), b.randn(batch, s, hk, d).transpose(1, 2)
                return (lambda: b.liger.liger_rope(qp.transpose(1, 2), kp.transpose(1, 2), cf, sf)), [qp, kp], [gq, gk]
            b.run("rope", shape, "liger", liger_make, nbytes)


def bench_ce(b: Bench) -> None:
    from loong.kernels import fused_linear_cross_entropy, fused_linear_cross_entropy_reference

    n = b.args.tokens
    for v in b.args.vocab:
        for h in b.args.hidden:
            shape = f"{n}x{h}->V{v}"
            flops = 6.0 * n * h * v  # logits, grad of hidden, grad of weight

            def make(fn, h=h, v=v):
                def inner():
                    hid, w = b.randn(n, h, grad=True), b.randn(v, h, grad=True, scale=h ** -0.5)
                    labels = torch.randint(0, v, (n,), device=b.dev)
                    labels[::50] = -100
                    return (lambda: fn(hid, w, labels)), [hid, w], [torch.ones((), device=b.dev)]
                return inner

            # event-timed calls, no graphs: the loss checks its labels on the host (Liger reads a count too)
            kw = {"flops": flops, "memory": True, "graph": False}
            b.run("cross_entropy", shape, "loong", make(
                lambda *a: fused_linear_cross_entropy(*a, backend=b.backend)), None, **kw)
            b.run("cross_entropy", shape, "loong16", make(
                lambda *a: fused_linear_cross_entropy(*a, fp32_accumulate=False, backend=b.backend)), None, **kw)
            b.run("cross_entropy", shape, "eager", make(fused_linear_cross_entropy_reference), None, **kw)
            if b.args.compile:
                b.run("cross_entropy", shape, "compile", make(b.compiled_fn(
                    "ce", fused_linear_cross_entropy_reference)), None, **kw)
            if b.liger is not None:
                b.run("cross_entropy", shape, "liger", make(b.liger.liger_fused_linear_cross_entropy), None, **kw)


def bench_fp8(b: Bench) -> None:
    import loong.kernels as K

    n = b.args.tokens
    h = 4096 if not b.args.dry_run else 256
    f = FFN.get(h, 4 * h)
    cases = [  # name, function, input rows x cols, kwargs
        ("tensorwise", K.quantize_tensorwise, (n, h), {}),
        ("rowwise", K.quantize_rowwise, (n, h), {}),
        ("1x128", K.quantize_blockwise, (n, h), {}),
        ("128x128", K.quantize_blockwise, (f, h), {"block_shape": (128, 128)}),
    ]
    for name, fn, (m, k), kw in cases:
        nbytes = m * k * (2 + 1)  # bf16 in, e4m3 out (scales are negligible)

        def make(fwd, m=m, k=k):
            def inner():
                x = b.randn(m, k, scale=3.0)
                return (lambda: fwd(x)), [], []
            return inner

        shape = f"{name} {m}x{k}"
        b.run("fp8_quant", shape, "loong", make(lambda x, fn=fn, kw=kw: fn(x, backend=b.backend, **kw)), nbytes,
              backward=False)
        b.run("fp8_quant", shape, "eager", make(lambda x, fn=fn, kw=kw: fn(x, backend="reference", **kw)), nbytes,
              backward=False)
        if b.args.compile:
            b.run("fp8_quant", shape, "compile", make(b.compiled_fn(
                f"fp8_{name}", lambda x, fn=fn, kw=kw: fn(x, backend="reference", **kw))), nbytes, backward=False)
        x = b.randn(m, k, scale=3.0)
        q, s = fn(x, backend="reference", **kw)
        nbytes = m * k * (1 + 2)
        b.run("fp8_dequant", shape, "loong", lambda q=q, s=s: ((lambda: K.dequantize(q, s, backend=b.backend)), [], []),
              nbytes, backward=False)
        b.run("fp8_dequant", shape, "eager", lambda q=q, s=s: ((lambda: K.dequantize(q, s, backend="reference")), [],
                                                               []), nbytes, backward=False)


def bench_tune(b: Bench) -> None:
    """The two knobs that were guesses: RMSNorm backward programs per SM, the loss's chunk size."""
    import loong.kernels.norm as norm
    from loong.kernels import fused_linear_cross_entropy, rms_norm

    n, h = b.args.tokens, 4096 if not b.args.dry_run else 64
    times = {}
    for hid in (b.args.hidden if not b.args.dry_run else [h]):
        for per_sm in (1, 2, 4, 8):
            norm.BWD_PROGRAMS_PER_SM = per_sm

            def make(hid=hid):
                x, w = b.randn(n, hid, grad=True), b.randn(hid, grad=True)
                return (lambda: rms_norm(x, w, 1e-6, backend=b.backend)), [x, w], [b.randn(n, hid)]

            b.run("tune_rms_bwd", f"{n}x{hid} {per_sm}/SM", "loong", make, 5 * n * hid * 2)
            times[per_sm] = times.get(per_sm, 0.0) + b.rows[-1].get("fwd_bwd_ms", float("inf"))
    best = min(times, key=times.get)
    norm.BWD_PROGRAMS_PER_SM = best  # used by the rest of this run; recorded in the JSON
    b.tuned["rms_norm_bwd_programs_per_sm"] = best
    print(f"  RMSNorm backward: {best} programs per SM (least total time over the hidden sizes)")
    v = b.args.vocab[0]
    for chunk in (1024, 2048, 4096, 8192):
        def make_ce(chunk=chunk):
            hid, w = b.randn(n, h, grad=True), b.randn(v, h, grad=True, scale=h ** -0.5)
            labels = torch.randint(0, v, (n,), device=b.dev)
            return (lambda: fused_linear_cross_entropy(hid, w, labels, chunk_size=chunk, backend=b.backend)), [hid, w], [
                torch.ones((), device=b.dev)]

        b.run("tune_ce_chunk", f"{n}x{h}->V{v} c={chunk}", "loong", make_ce, None, 6.0 * n * h * v, memory=True,
              graph=False)


def summary(b: Bench) -> dict:
    """Targets: memory-bound kernels fwd+bwd at >= 85% of copy bandwidth; the loss vs Liger and eager."""
    out: dict = {}
    for r in b.rows:
        if r["impl"] == "loong" and "frac_copy" in r and r["op"] in ("rms_norm", "rms_norm_residual", "swiglu", "rope"):
            out.setdefault("fwd_bwd_frac_of_copy", {})[f"{r['op']} {r['shape']}"] = round(r["frac_copy"], 3)
    by = {(r["op"], r["shape"], r["impl"]): r for r in b.rows if "error" not in r}
    for (op, shape, impl), r in by.items():
        if op != "cross_entropy" or not impl.startswith("loong"):
            continue
        eager, liger = by.get((op, shape, "eager")), by.get((op, shape, "liger"))
        entry = {"time_ms": round(r["fwd_bwd_ms"], 2), "peak_gib": r.get("peak_gib")}
        if liger:
            entry["speed_vs_liger"] = round(liger["fwd_bwd_ms"] / r["fwd_bwd_ms"], 3)
        if eager and r.get("peak_gib") and eager.get("peak_gib"):
            entry["peak_fraction_of_eager"] = round(r["peak_gib"] / eager["peak_gib"], 3)
        out.setdefault(f"cross_entropy ({impl})", {})[shape] = entry
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--vocab", type=int, nargs="+", default=[128256, 151936])
    p.add_argument("--only", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile column")
    p.add_argument("--warmup-ms", type=float, default=25)
    p.add_argument("--rep-ms", type=float, default=200)
    p.add_argument("--graph-rep-ms", type=float, default=30)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU through Triton's interpreter")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default: results/kernels_<gpu>_<date>.json)")
    args = p.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        args.tokens, args.hidden, args.vocab, args.compile = 32, [64], [500], False
    elif not torch.cuda.is_available():
        sys.exit("kernels.py needs a CUDA GPU (or --dry-run)")
    b = Bench(args)
    b.backend = "triton"  # the Loong column must be the kernel, never a silent fallback
    hw = host()
    b.measure_copy()
    print(f"{'':2}{'op':<18}{'shape':<26}{'impl':<9}{'fwd ms':>9}{'f+b ms':>9}{'GB/s':>8}{'%copy':>6}")
    out = Path(args.out) if args.out else RESULTS / (
        f"kernels_{(hw.get('gpu') or 'cpu').split()[-1].lower()}_{time.strftime('%Y%m%d')}.json")
    t0 = time.time()
    for op in args.only:
        {"rms_norm": lambda: bench_rms(b, False), "rms_norm_residual": lambda: bench_rms(b, True),
         "swiglu": lambda: bench_swiglu(b), "rope": lambda: bench_rope(b), "cross_entropy": lambda: bench_ce(b),
         "fp8": lambda: bench_fp8(b), "tune": lambda: bench_tune(b)}[op]()
        result = {"benchmark": "kernels", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(["python benchmarks/kernels.py", *sys.argv[1:]]), "args": vars(args),
                  "versions": versions(["torch", "triton", "loong-kernels", "liger-kernel"]), "hardware": hw,
                  "copy_bandwidth_gbs": b.copy_gbs, "bytes_counted": "minimal fwd+bwd traffic (see docstring)",
                  "torch_compile": "torch.compile(reference) with default settings", "wall_s": round(time.time() - t0),
                  "timing": "fwd_ms/fwd_bwd_ms: CUDA-graph replay (device time) for memory-bound ops, event-timed "
                            "calls for the loss; *_launch: event-timed calls", "tuned": b.tuned,
                  "summary": summary(b), "rows": b.rows}
        if not args.dry_run or args.out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")  # after every section: a timeout keeps the rest
    print(json.dumps(summary(b), indent=1))
    if b.rows and (not args.dry_run or args.out):
        print(f"wrote {out}")
    errors = [r for r in b.rows if "error" in r]
    if errors:
        print(f"{len(errors)} measurements failed (see 'error' in the JSON)")


if __name__ == "__main__":
    main()
