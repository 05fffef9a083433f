"""End-to-end training step of `loong-llm train` with and without loong-kernels' fused kernels.

The same run (default: the ``llama3_2_1b`` preset, 1.24B parameters, bf16, AdamW) is made with
``model.fused_kernels=off`` (megatron-core's PyTorch norms, GLU, RoPE and logits + cross-entropy) and
``model.fused_kernels=on`` (fused RMSNorm, SwiGLU, RoPE and chunked linear + cross-entropy), each in its
own process, then optionally fused at further micro-batch sizes (``--fused-mbs``) that the freed memory
allows. Prints a table and writes JSON (command, versions, hardware, figures) to ``benchmarks/results/``.

    python benchmarks/llm_fused_step.py --preset llama3_2_1b --seq 4096 --mbs 4 --gbs 16 --steps 25
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from _env import host, versions  # benchmarks/_env.py (run as scripts from the repo root)
from llm_throughput import _loong

RESULTS = Path(__file__).parent / "results"


def _row(args: argparse.Namespace, mode: str, mbs: int, tmp: Path) -> dict:
    run = argparse.Namespace(**{**vars(args), "mbs": mbs})
    r = _loong(run, tmp, (f"model.fused_kernels={mode}",), run_name=f"{mode}_mbs{mbs}")
    r.update(fused_kernels=mode, micro_batch_size=mbs)
    if "tokens_per_s" in r:
        r["step_time_s"] = round(args.gbs * args.seq / r["tokens_per_s"], 4)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3_2_1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--gbs", type=int, default=16)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the figures")
    p.add_argument("--fused-mbs", type=int, nargs="*", default=[], help="extra fused runs at these micro-batches")
    p.add_argument("--out", default=None, help="JSON path (default: results/llm_fused_step_<gpu>_<preset>_<date>.json)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [_row(args, "off", args.mbs, Path(tmp)), _row(args, "on", args.mbs, Path(tmp))]
        rows += [_row(args, "on", m, Path(tmp)) for m in args.fused_mbs]
    print(f"\n{args.preset}  seq={args.seq} global-batch={args.gbs} steps={args.steps} (median after {args.warmup})")
    print(f"{'fused_kernels':<15}{'mbs':>5}{'step s':>9}{'tokens/s':>11}{'MFU':>8}{'peak GiB':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['fused_kernels']:<15}{r['micro_batch_size']:>5}  failed: {r['error'].strip().splitlines()[-1][:80]}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        print(f"{r['fused_kernels']:<15}{r['micro_batch_size']:>5}{r['step_time_s']:>9.3f}{r['tokens_per_s']:>11,.0f}"
              f"{mfu:>8}{mem:>10}")
    if all("error" not in r for r in rows[:2]):
        print(f"fused speed-up at mbs={args.mbs}: {rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x")
    hw = host()
    result = {"benchmark": "llm_fused_step", "date": time.strftime("%Y-%m-%d"),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "args": vars(args),
              "versions": versions(["torch", "megatron-core", "triton", "loong-core", "loong-kernels", "loong-llm"]),
              "hardware": hw, "runs": rows}
    RESULTS.mkdir(exist_ok=True)
    tag = (hw.get("gpu") or "cpu").split()[-1].lower()
    out = Path(args.out) if args.out else RESULTS / f"llm_fused_step_{tag}_{args.preset}_{time.strftime('%Y%m%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
