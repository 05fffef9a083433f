"""MoE experts on one GPU: megatron-core's ``SequentialMLP`` loop against ``model.moe_grouped_mm`` (torch._grouped_mm).

Each row is ``loong-llm train model=<preset>`` in its own process, on the package's corpus, from the same seed, with
the same schedule; the rows differ only in ``model.moe_grouped_mm``. Per row: median tokens/s and MFU after
``--warmup`` steps, peak memory, the first and last loss (the two must train alike; bf16 products accumulate in
another order, so not bitwise). Prints a table and writes JSON (command, versions, hardware, figures) to
``benchmarks/results/``. Extra ``key=value`` arguments go to every row.

    python benchmarks/moe_experts.py                                   # qwen3_30b_a3b_4l: 128 experts of 768
    python benchmarks/moe_experts.py --preset deepseek_v3_4l --gbs 4
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
ROWS = {"loop": "model.moe_grouped_mm=false", "grouped_mm": "model.moe_grouped_mm=true"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3_30b_a3b_4l")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--out", default=None, help="JSON path (default: results/moe_experts_<gpu>_<preset>_<date>.json)")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for every row")
    args = p.parse_args()
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.rows:
            print(f"running {name} ...", flush=True)
            rows[name] = _loong(args, Path(tmp), (*args.overrides, ROWS[name]), run_name=name)
    print(f"\n{args.preset}, {args.gbs} x {args.seq} tokens per step, {args.steps} steps")
    print(f"{'row':<11}{'tokens/s':>10}{'MFU':>8}{'peak GiB':>10}  first -> last loss")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<11} failed: {r['error'].strip().splitlines()[-1][:100]}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        first, last = r["loss_first_last"]
        print(f"{name:<11}{r['tokens_per_s']:>10,.0f}{mfu:>8}{r['peak_memory_gib'] or 0:>10.1f}  {first:.4f} -> {last:.4f}")
    if all("error" not in r for r in rows.values()) and len(rows) == 2:
        print(f"grouped_mm / loop: {rows['grouped_mm']['tokens_per_s'] / rows['loop']['tokens_per_s']:.2f}x")
    hw = host()
    tag = (hw.get("gpu") or "cpu").split()[-1].lower()
    out = Path(args.out or RESULTS / f"moe_experts_{tag}_{args.preset}_{time.strftime('%Y%m%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "moe_experts", "date": time.strftime("%Y-%m-%d"),
                               "command": " ".join(["python", "benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]]),
                               "args": vars(args), "versions": versions(["torch", "megatron-core", "loong-llm"]),
                               "hardware": hw, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
