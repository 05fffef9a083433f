"""One Wan block, eager against ``torch.compile``, on the same inputs: the output's and every gradient's relative error.

Why it exists: at the Wan2.1-T2V-1.3B shape on an H200 (torch 2.11) the compiled block's gradient of its modulation
table differed from eager by ~10% at batch 1 (docs/performance.md, the Wan section), while the loss curves of some
compiled runs still tracked eager. This check isolates one block (the preset's width and heads, 21×30×52 = 32,760
tokens on CUDA; a tiny grid on CPU), random bf16 weights and inputs, two forward/backward passes (the second one is
compared, after any recompilation), for each case of ``--cases`` (``b<batch>_<none|selective>``: batch size and
whether the feed-forward is checkpointed as ``model.recompute=selective`` does; a ``_nosplit`` suffix compiles with
inductor's ``split_reductions`` off, ``_nopersist`` with its persistent Triton reductions off, to test whether
either causes the error). The compiled block takes the Wan task's inductor options (``loong.diffusion.task.COMPILE_OPTIONS``:
mix-order reductions off, the fix for the fault); a ``_mix`` suffix turns inductor's mix-order reductions (one
kernel reducing a tensor over both of its dimensions, as a norm's backward does) back on, which reproduces the
fault. ``--grid`` changes the token count). Relative error = max |compiled −
eager| / max |eager|; bf16 rounding alone gives ~1e-2 at most here. Prints a table and writes JSON to
``benchmarks/results/``.

    python benchmarks/wan_compile_check.py                       # H200: the 1.3B block, three cases (~2 min)
    python benchmarks/wan_compile_check.py --preset tiny         # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from _env import host, versions  # benchmarks/_env.py (run as scripts from the repo root)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

RESULTS = Path(__file__).parent / "results"


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def run_case(preset: str, batch: int, recompute: str, grid: tuple[int, int, int], text_len: int,
             split_reductions: bool = True, persistent_reductions: bool = True,
             mix_order_reduction: bool = False) -> dict:
    from loong.core.attention import CPGroups
    from loong.diffusion.models.wan import PRESETS
    from loong.diffusion.models.wan.block import WanBlock
    from loong.diffusion.models.wan.rope import grid_positions, rope_angles
    from loong.diffusion.task import COMPILE_OPTIONS

    cfg = PRESETS[preset]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    caps = {"triton", "flex_attention"} if dev == "cuda" else set()
    torch.manual_seed(0)
    eager = WanBlock(cfg, CPGroups(), caps, None).to(dev)
    with torch.no_grad():
        for p in eager.parameters():
            p.normal_(0, 0.02)
    eager = eager.to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    if recompute == "selective":
        compiled.ffn = checkpoint_wrapper(compiled.ffn)
    torch._dynamo.reset()
    torch._inductor.config.split_reductions = split_reductions
    torch._inductor.config.triton.persistent_reductions = persistent_reductions
    compiled.compile(options={**COMPILE_OPTIONS, "triton.mix_order_reduction": mix_order_reduction})
    n = grid[0] * grid[1] * grid[2]
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(batch, n, cfg.dim, device=dev, generator=g).bfloat16()
    text = torch.randn(batch, text_len, cfg.dim, device=dev, generator=g).bfloat16()
    modulation = torch.randn(batch, 6, cfg.dim, device=dev, generator=g) * 0.1
    cos, sin = rope_angles(grid_positions(*grid, device=dev), cfg.rope_dims)
    grad_out = torch.randn(batch, n, cfg.dim, device=dev, generator=g).bfloat16()
    results = {}
    reference = copy.deepcopy(eager).float()  # fp32 eager: which of the two bf16 runs is the accurate one
    for name, block in (("eager", eager), ("compiled", compiled), ("fp32", reference)):
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        xi, mi = x.detach().to(dtype).clone().requires_grad_(), modulation.clone().requires_grad_()
        for _ in range(2):
            block.zero_grad(set_to_none=True)
            xi.grad = mi.grad = None
            out = block(xi, text.to(dtype), None, mi, cos, sin)
            out.backward(grad_out.to(dtype))
        params = {k.replace("._checkpoint_wrapped_module", ""): p.grad.float() for k, p in block.named_parameters()}
        results[name] = (out.detach().float(), xi.grad.float(), mi.grad.float(), params)
    e, c, f = results["eager"], results["compiled"], results["fp32"]
    grads = {k: rel(c[3][k], v) for k, v in e[3].items()}
    vs_fp32 = {"eager_modulation": rel(e[3]["modulation"], f[3]["modulation"]),
               "compiled_modulation": rel(c[3]["modulation"], f[3]["modulation"]),
               "eager_modulation_input": rel(e[2], f[2]), "compiled_modulation_input": rel(c[2], f[2])}
    worst = sorted(grads.items(), key=lambda kv: -kv[1])[:4]
    torch._inductor.config.split_reductions = True
    torch._inductor.config.triton.persistent_reductions = True
    suffix = (("" if split_reductions else "_nosplit") + ("" if persistent_reductions else "_nopersist")
              + ("_mix" if mix_order_reduction else ""))
    return {"case": f"b{batch}_{recompute}{suffix}", "tokens": n, "out": rel(c[0], e[0]), "grad_x": rel(c[1], e[1]),
            "grad_modulation_input": rel(c[2], e[2]), "worst_param_grads": dict(worst), "vs_fp32_eager": vs_fp32,
            "param_grads": grads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="wan2_1_t2v_1_3b")
    p.add_argument("--cases", nargs="+", default=["b1_none", "b1_selective", "b2_none", "b1_none_mix"])
    p.add_argument("--out", default=None, help="JSON path (default: results/wan_compile_check_<gpu>_<date>.json)")
    p.add_argument("--grid", type=int, nargs=3, default=None, metavar=("F", "H", "W"),
                   help="the latent token grid (default: 21 30 52 on CUDA, 2 4 4 on the CPU)")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    grid, text_len = ((21, 30, 52), 512) if gpu else ((2, 4, 4), 7)
    if args.grid:
        grid = tuple(args.grid)
    rows = []
    for case in args.cases:
        batch, recompute, *flags = case.split("_")
        rows.append(run_case(args.preset, int(batch[1:]), recompute, grid, text_len, "nosplit" not in flags,
                             "nopersist" not in flags, "mix" in flags))
        r = rows[-1]
        print(f"{r['case']:<14} out {r['out']:.2e}  dx {r['grad_x']:.2e}  d(modulation input) "
              f"{r['grad_modulation_input']:.2e}  worst params {', '.join(f'{k} {v:.2e}' for k, v in r['worst_param_grads'].items())}; against fp32 eager: "
              f"{', '.join(f'{k} {v:.2e}' for k, v in r['vs_fp32_eager'].items())}",
              flush=True)
    hw = host()
    name = (hw.get("gpu") or "cpu").split()[-1].lower()
    out = Path(args.out) if args.out else RESULTS / f"wan_compile_check_{name}_{time.strftime('%Y%m%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "wan_compile_check", "date": time.strftime("%Y-%m-%d"),
                               "command": "python benchmarks/wan_compile_check.py " + " ".join(
                                   f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                                   for k, v in vars(args).items() if v is not None),
                               "versions": versions(["torch", "triton", "loong-core", "loong-kernels", "loong-diffusion"]), "hardware": hw, "preset": args.preset, "grid": grid,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
