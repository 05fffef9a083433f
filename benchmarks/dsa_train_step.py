"""Long-sequence training steps of a reduced DeepSeek-V3.2 on one GPU: fused DSA kernels against the references.

``loong-llm train model=deepseek_v3_2_4l`` (real widths, 4 layers; docs/moe.md) at ``--seq`` tokens (default
65536, one sequence per step, ``model.recompute=full``), twice, each in its own process:

- ``fused``: ``model.fused_kernels=auto`` — loong-kernels' DSA indexer top-k and sparse MLA attention (and the
  fused norm / SwiGLU / RoPE / linear + cross-entropy);
- ``reference``: ``model.fused_kernels=off`` — the plain-PyTorch references and megatron-core's modules.

Per row: whether the step ran or ran out of memory, the median step time and tokens/s after the first step,
peak memory and the losses. Prints a table and writes JSON (command, versions, hardware, figures) to
``benchmarks/results/``. Extra ``key=value`` arguments go to both runs (e.g. ``model.num_experts=8``).

    python benchmarks/dsa_train_step.py                      # 64K tokens
    python benchmarks/dsa_train_step.py --seq 32768 --rows fused model.dsa_stage=dense_warmup
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
ROWS = {"fused": "model.fused_kernels=auto", "reference": "model.fused_kernels=off"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="deepseek_v3_2_4l")
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--out", default=None, help="JSON path (default: results/dsa_train_step_<gpu>_<seq>_<date>.json)")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs")
    args = p.parse_args()
    run = argparse.Namespace(preset=args.preset, seq=args.seq, mbs=1, gbs=1, steps=args.steps, warmup=1,
                             lr=1e-4, min_lr=1e-5, lr_warmup=0)
    common = ("model.recompute=full", *args.overrides)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.rows:
            print(f"running {name} ...", flush=True)
            r = _loong(run, Path(tmp), (*common, ROWS[name]), run_name=name)
            if "error" in r:
                r["outcome"] = "OOM" if "OutOfMemoryError" in r["error"] or "out of memory" in r["error"] else "failed"
            else:
                r["outcome"] = "ran"
                r["step_time_s"] = round(args.seq / r["tokens_per_s"], 3)
            rows[name] = r
    print(f"\n{args.preset}, {args.seq} tokens per step, {args.steps} steps, model.recompute=full")
    print(f"{'row':<11}{'outcome':>9}{'step s':>9}{'tokens/s':>10}{'peak GiB':>10}  losses")
    for name, r in rows.items():
        if r["outcome"] != "ran":
            print(f"{name:<11}{r['outcome']:>9}  {r['error'].strip().splitlines()[-1][:90]}")
            continue
        print(f"{name:<11}{'ran':>9}{r['step_time_s']:>9.2f}{r['tokens_per_s']:>10,.0f}{r['peak_memory_gib'] or 0:>10.1f}"
              f"  {', '.join(f'{x:.4f}' for x in r['losses'])}")
    hw = host()
    tag = (hw.get("gpu") or "cpu").split()[-1].lower()
    out = Path(args.out or RESULTS / f"dsa_train_step_{tag}_{args.seq}_{time.strftime('%Y%m%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "dsa_train_step", "date": time.strftime("%Y-%m-%d"),
                               "command": " ".join(["python", "benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]]),
                               "args": vars(args),
                               "versions": versions(["torch", "megatron-core", "triton", "loong-core", "loong-kernels",
                                                     "loong-llm"]),
                               "hardware": hw, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
