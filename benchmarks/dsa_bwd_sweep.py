"""Block sizes of the DSA sparse attention backward, timed on one GPU at DeepSeek-V3.2's shape.

Times the backward alone (``torch.autograd.grad`` of one forward, repeated) for the fused kernel at its
``BWD_CONFIG`` and for the two-pass backward at each ``--dq-configs`` (with the first ``--dkv-configs``), then
at the fastest dq pass with each ``--dkv-configs``. A configuration that does not compile (shared memory, for
instance) is recorded with its error. Every row's gradients are compared with the first row's (relative L2).

    python benchmarks/dsa_bwd_sweep.py            # 8K tokens, about a minute on an H200

TFLOP/s use ``benchmarks/dsa.py``'s count: the backward is 2.5x the forward's ``2 * S * K * H * (D_qk + v_dim)``.
Prints one line per configuration and writes JSON to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _env import host, versions  # benchmarks/_env.py (run as scripts from the repo root)
from dsa import attention_inputs

KEYS = ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages")


def _cfg(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if len(values) != len(KEYS):
        raise argparse.ArgumentTypeError(f"expected {','.join(KEYS)}, got {text!r}")
    return values


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--dq-configs", type=_cfg, nargs="+",
                   default=[_cfg(c) for c in ("64,32,8,1", "64,16,8,1", "32,32,8,1", "64,64,8,1")])
    p.add_argument("--dkv-configs", type=_cfg, nargs="+",
                   default=[_cfg(c) for c in ("64,64,8,1", "128,64,8,1", "64,32,8,1", "128,32,8,1", "32,64,8,1",
                                              "64,32,4,1")])
    p.add_argument("--budget-s", type=float, default=300, help="start no configuration after this many seconds")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("dsa_bwd_sweep.py needs a CUDA GPU")
    from triton.testing import do_bench

    from loong.kernels.dsa import attention, sparse_mla_attention

    t0 = time.time()
    s, h, d, v, k = args.seqlen, args.heads, 576, 512, args.topk
    q, kv, idx, dout = attention_inputs(s, h, d, v, k, 64, 128, torch.bfloat16, "cuda", "triton")  # dsa.py's inputs
    bwd_tflop = 2.5 * 2.0 * s * k * h * (d + v) / 1e12
    out, _ = sparse_mla_attention(q, kv, idx, softmax_scale=d ** -0.5, v_dim=v, backend="triton")
    rows: list[dict] = []
    first: tuple[torch.Tensor, ...] | None = None

    def run(split: bool, bwd: tuple | None = None, dq: tuple | None = None, dkv: tuple | None = None) -> float | None:
        nonlocal first
        row: dict = {"backward": "split" if split else "fused"}
        if split:
            row.update(dq_config=dict(zip(KEYS, dq, strict=True)), dkv_config=dict(zip(KEYS, dkv, strict=True)))
            attention.DQ_CONFIG, attention.DKV_CONFIG = row["dq_config"], row["dkv_config"]
        else:
            row["bwd_config"] = attention.BWD_CONFIG = dict(zip(KEYS, bwd, strict=True))
        attention.BWD_SPLIT = split
        label = " ".join(f"{key[:-7]} {','.join(map(str, row[key].values()))}" for key in row if key != "backward")
        if time.time() - t0 > args.budget_s:
            print(f"{row['backward']} {label}: skipped (--budget-s)", flush=True)
            return None
        grads = lambda: torch.autograd.grad(out, (q, kv), dout, retain_graph=True)  # noqa: E731
        try:
            got = grads()
            row["ms"] = do_bench(grads, warmup=50, rep=300)
        except Exception as e:  # noqa: BLE001 (a configuration that does not compile is a result)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"{row['backward']} {label}: {row['error']}", flush=True)
            rows.append(row)
            return None
        row["bwd_tflops"] = bwd_tflop / row["ms"] * 1e3
        if first is None:
            first = got
        else:
            row["rel_err_vs_first"] = [_rel(a, b) for a, b in zip(got, first, strict=True)]
        rows.append(row)
        print(f"{row['backward']} {label}: {row['ms']:.2f} ms, {row['bwd_tflops']:.1f} TFLOP/s", flush=True)
        return row["ms"]

    run(False, bwd=tuple(attention.BWD_CONFIG[key] for key in KEYS))
    timed = {dq: run(True, dq=dq, dkv=args.dkv_configs[0]) for dq in args.dq_configs}
    timed = {c: ms for c, ms in timed.items() if ms is not None}
    if timed:
        best_dq = min(timed, key=timed.get)
        for dkv in args.dkv_configs[1:]:
            run(True, dq=best_dq, dkv=dkv)
    hw = host()
    out_path = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        f"dsa_bwd_sweep_{(hw.get('gpu') or 'gpu').split()[-1].lower()}_{time.strftime('%Y%m%d')}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({
        "benchmark": "dsa_bwd_sweep", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python benchmarks/dsa_bwd_sweep.py", *sys.argv[1:]]),
        "shape": {"seqlen": s, "heads": h, "d_qk": d, "v_dim": v, "topk": k, "dtype": "bfloat16"},
        "versions": versions(["torch", "triton", "loong-kernels"]), "hardware": hw,
        "flops_counted": "bwd 2.5 * 2*S*K*H*(D_qk+v_dim)", "timing": "triton.testing.do_bench median",
        "wall_s": round(time.time() - t0), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
