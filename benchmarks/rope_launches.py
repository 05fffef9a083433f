"""apply_rope with q and k in one kernel launch (now) against one launch per tensor (before 273d87d), on one GPU.

    git show 273d87d~1:packages/loong-kernels/src/loong/kernels/rope.py > /tmp/old_rope/old_rope.py
    python benchmarks/rope_launches.py --old /tmp/old_rope results/rope_launches_<gpu>_<date>.json

LLaMA-3-style shapes (head 128, 8 KV heads, 16K tokens as 4 x 4096, bf16): the forward of q + k, and forward +
backward (``torch.autograd.backward`` into the leaves, so the backward also accumulates into ``.grad``: that add is
the same in both columns and makes the forward + backward column a poor measure of the kernels themselves), with
``triton.testing.do_bench``; plus device-to-device copy bandwidth as the ceiling.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

from loong.kernels import rope as new_rope


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="folder holding old_rope.py (the per-tensor-launch version)")
    p.add_argument("out", help="JSON path")
    args = p.parse_args()
    sys.path.insert(0, args.old)
    import old_rope

    rows = []
    d, batch, s = 128, 4, 4096
    inv = new_rope.rope_inv_freq(d, 500000.0, llama3={}, device="cuda")
    cos, sin = new_rope.rope_cos_sin(torch.arange(s, device="cuda"), inv)
    for hidden, hk in ((2048, 8), (4096, 8), (8192, 8)):
        hq = hidden // d
        q = torch.randn(s, batch, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(s, batch, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        row: dict = {"shape": f"{s}x{batch}x({hq}+{hk})x{d}"}
        for name, mod in (("two_launches", old_rope), ("one_launch", new_rope)):
            def step(mod=mod, q=q, k=k, gq=gq, gk=gk) -> None:
                qo, ko = mod.apply_rope(q, k, cos, sin, backend="triton")
                torch.autograd.backward((qo, ko), (gq, gk))

            def fwd(mod=mod, q=q, k=k) -> None:
                with torch.no_grad():
                    mod.apply_rope(q, k, cos, sin, backend="triton")

            row[name + "_fwd_bwd_us"] = round(triton.testing.do_bench(step, warmup=25, rep=200) * 1000, 1)
            row[name + "_fwd_us"] = round(triton.testing.do_bench(fwd, warmup=25, rep=200) * 1000, 1)
        nbytes = 4 * s * batch * (hq + hk) * d * 2
        row["one_launch_GBps"] = round(nbytes / row["one_launch_fwd_bwd_us"] / 1e3, 1)
        row["two_launches_GBps"] = round(nbytes / row["two_launches_fwd_bwd_us"] / 1e3, 1)
        print(row, flush=True)
        rows.append(row)
    x = torch.empty(2 ** 28, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_us = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200) * 1000
    copy = round(2 * x.numel() * 2 / copy_us / 1e3, 1)
    print({"copy_GBps": copy})
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "copy_GBps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
