"""torch's SDPA backends at Wan2.1-T2V-1.3B's self-attention shape on one GPU: which kernel torch picks by default,
against cuDNN's and FlashAttention-2's forced, forward + backward in bf16.

One call is ``[1, 12, 32760, 128]`` q/k/v (32,760 video tokens of an 81×480×832 clip, 12 heads of 128), non-causal;
the median of 5 timed calls after 2 warm-ups. TFLOP/s counts the forward as 4·heads·s²·d and the backward as 2.5
forwards. Prints a table and writes JSON (command, versions, hardware, figures) to ``benchmarks/results/``.

    python benchmarks/sdpa_backends.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _env import host, versions  # benchmarks/_env.py (run as scripts from the repo root)

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=32760)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=None, help="JSON path (default: results/sdpa_backends_<gpu>_<date>.json)")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    shape = (1, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flops = 4 * args.heads * args.seq**2 * args.head_dim * 3.5
    rows: dict[str, dict] = {}
    for name, backends in (("default", None), ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
                           ("flash", [SDPBackend.FLASH_ATTENTION])):
        def call(backends: list | None = backends) -> None:
            if backends is None:
                out = F.scaled_dot_product_attention(q, k, v)
            else:
                with sdpa_kernel(backends):
                    out = F.scaled_dot_product_attention(q, k, v)
            out.sum().backward()

        try:
            times = []
            for i in range(7):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(times)
            rows[name] = {"ms": round(ms, 2), "tflops": round(flops / (ms / 1e3) / 1e12, 1)}
        except RuntimeError as exc:  # a backend that does not take this shape or device
            rows[name] = {"error": str(exc).splitlines()[0][:300]}
    lines = [f"{'backend':<10}{'ms fwd+bwd':>12}{'TFLOP/s':>10}"]
    for name, r in rows.items():
        lines.append(f"{name:<10}{r['ms']:>12.1f}{r['tflops']:>10.0f}" if "ms" in r else f"{name:<10}  {r['error']}")
    print(f"SDPA {list(shape)} bf16, non-causal\n" + "\n".join(lines))
    hw = host()
    tag = (hw.get("gpu") or "cpu").split()[-1].lower()
    out = Path(args.out or RESULTS / f"sdpa_backends_{tag}_{time.strftime('%Y%m%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "sdpa_backends", "date": time.strftime("%Y-%m-%d"),
                               "command": " ".join(["python", "benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]]),
                               "args": vars(args), "versions": versions(["torch"]), "hardware": hw, "table": lines,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
