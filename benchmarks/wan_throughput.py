"""Wan2.1-T2V-1.3B training on one GPU: a plain diffusers loop beside ``loong-diffusion``'s fsdp-engine run.

Every row trains the Wan2.1-T2V-1.3B shape (30 layers, width 1536, 12 heads, FFN 8960; random weights) on one
480×832×81-frame clip a step: latents 16×21×60×104 → 32,760 video tokens, 512 text tokens of width 4096, the
flow-matching loss (x_t = (1 − σ)·x₀ + σ·ε, target ε − x₀), AdamW (fused) at a constant learning rate. Each row runs
in its own process (clean memory statistics). Rows:

- ``diffusers_bf16``: ``diffusers.WanTransformer3DModel`` with bf16 weights, gradient checkpointing and fused AdamW,
  its own loop (the faster of the two diffusers rows measured before Loong had a diffusion package);
- ``diffusers_fp32``: the same with fp32 weights under bf16 autocast (what diffusers' training scripts do with mixed
  precision); without checkpointing it does not fit in 141 GB;
- ``loong_<recompute>``: ``loong-diffusion train`` through the real walk (``loong.core.run.run``: the fsdp engine,
  FSDP2 over one rank, bf16 compute with fp32 master weights, Loong's own Wan modules) on its synthetic moving-shapes
  latents of the same shape, with ``model.recompute`` = none, selective (each block's MLP) or full;
  ``loong_selective_compile`` / ``loong_none_compile`` add ``train.compile=true`` (inductor then fuses the norms and
  RoPE instead of loong-kernels); ``loong_none_compile_fp8`` / ``loong_selective_compile_fp8`` add
  ``precision.fp8=tensorwise`` to those (the linear layers' GEMMs in FP8; attention stays bf16);
- ``loong_packed``: mixed resolutions and durations packed into micro-batches of at most ``--pack-tokens`` video
  tokens (``data.sizes``, ``data.pack_tokens``: varlen attention, each clip its own RoPE grid and timestep),
  ``--packed-gbs`` clips a step.

Columns: seconds per step and video tokens/s (medians after ``--warmup`` steps; a step's wall time to a device
sync), MFU = (6·N·tokens + 12·layers·width·Σ clip tokens²) / step time / 989 TFLOP/s (an H200's dense bf16 peak;
self-attention counted as in ``../shared/research/h200-wave2-anchors.md``, recomputation and cross-attention not
counted), peak device memory. Prints a table and writes JSON (command, versions, hardware, figures) to
``benchmarks/results/``.

    python benchmarks/wan_throughput.py                           # every row (estimated 8 min on an H200)
    python benchmarks/wan_throughput.py --rows diffusers_bf16 loong_none
    python benchmarks/wan_throughput.py --preset tiny --frames 2 --height 8 --width 8 --text-len 8 --steps 3 \\
        --warmup 1 --rows diffusers_bf16 loong_none loong_packed --packed-sizes 2x8x8 1x8x8 --pack-tokens 48  # CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _env import host, run_child, versions  # benchmarks/_env.py (run as scripts from the repo root)

RESULTS = Path(__file__).parent / "results"
PEAK_BF16 = 989e12

ROWS: dict[str, str] = {
    "diffusers_bf16": "diffusers, bf16 weights + checkpointing",
    "diffusers_fp32": "diffusers, fp32 weights + autocast + checkpointing",
    "loong_none": "Loong, no recompute",
    "loong_selective": "Loong, selective recompute (MLP)",
    "loong_full": "Loong, full recompute",
    "loong_selective_compile": "Loong, selective recompute + compile",
    "loong_none_compile": "Loong, no recompute + compile",
    "loong_packed": "Loong, packed mixed resolutions",
    "loong_none_compile_fp8": "Loong, no recompute + compile + FP8 linears",
    "loong_selective_compile_fp8": "Loong, selective recompute + compile + FP8",
}
#: a Loong row's (model.recompute, train.compile, precision.fp8)
LOONG_ROWS = {"loong_none": ("none", False, "off"), "loong_selective": ("selective", False, "off"),
              "loong_full": ("full", False, "off"), "loong_selective_compile": ("selective", True, "off"),
              "loong_none_compile": ("none", True, "off"), "loong_packed": ("selective", False, "off"),
              "loong_none_compile_fp8": ("none", True, "tensorwise"),
              "loong_selective_compile_fp8": ("selective", True, "tensorwise")}


def _sizes(text: list[str]) -> list[list[int]]:
    return [[int(x) for x in s.split("x")] for s in text]


def _step_flops(wan: object, tokens: list[int]) -> float:
    """Training FLOPs of one step over clips of ``tokens`` video tokens each (the module docstring's count)."""
    n = wan.num_parameters(active=True)  # type: ignore[attr-defined]
    return 6.0 * n * sum(tokens) + 12.0 * wan.num_layers * wan.dim * sum(t * t for t in tokens)  # type: ignore[attr-defined]


def _diffusers_worker(args: argparse.Namespace) -> None:
    """A diffusers row in this process; prints one JSON line."""
    import torch
    from diffusers import WanTransformer3DModel

    from loong.diffusion.models.wan import config_to_diffusers
    from loong.diffusion.models.wan.config import wan_preset
    from loong.diffusion.task import clip_tokens

    wan = wan_preset(args.preset)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    fields = {k: v for k, v in config_to_diffusers(wan).items() if not k.startswith("_")}
    torch.manual_seed(args.seed)
    model = WanTransformer3DModel(**fields)
    bf16_weights = args.diffusers_worker == "diffusers_bf16"
    model = model.to(device, dtype=torch.bfloat16 if bf16_weights and gpu else torch.float32)
    model.enable_gradient_checkpointing()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=gpu)
    g = torch.Generator(device=device).manual_seed(args.seed)
    shape = (1, wan.in_channels, args.frames, args.height, args.width)
    dtype = next(model.parameters()).dtype
    times, losses = [], []
    for _ in range(args.steps):
        x0 = torch.randn(shape, generator=g, device=device, dtype=dtype)
        noise = torch.randn(shape, generator=g, device=device, dtype=dtype)
        sigma = torch.rand((1,), generator=g, device=device)
        text = torch.randn(1, args.text_len, wan.text_dim, generator=g, device=device, dtype=dtype)
        noisy = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * noise
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu and not bf16_weights):
            pred = model(hidden_states=noisy.to(dtype), timestep=1000 * sigma, encoder_hidden_states=text,
                         return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), (noise - x0).float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the step's device sync
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[args.warmup:])
    tokens = clip_tokens([args.frames, args.height, args.width], wan.patch_size)
    print(json.dumps({"s_per_step": round(step_s, 4), "tokens_per_s": round(tokens / step_s, 1),
                      "mfu": round(_step_flops(wan, [tokens]) / step_s / PEAK_BF16, 4) if gpu else None,
                      "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
                      "loss_last": losses[-1]}))


def _loong_worker(args: argparse.Namespace) -> None:
    """A Loong row through ``loong.core.run.run`` in this process; prints one JSON line."""
    import torch

    from loong.core.config import from_dict
    from loong.core.run import run
    from loong.diffusion.models.wan.config import wan_preset
    from loong.diffusion.schema import DiffusionRunConfig
    from loong.diffusion.task import clip_tokens

    name = args.loong_worker
    recompute, compile_, fp8 = LOONG_ROWS[name]
    gpu = torch.cuda.is_available()
    packed = name == "loong_packed"
    data = {"frames": args.frames, "height": args.height, "width": args.width, "text_len": args.text_len,
            "num_clips": 16, "num_classes": 4}
    if packed:
        data.update(sizes=_sizes(args.packed_sizes), pack_tokens=args.pack_tokens)
    gbs = args.packed_gbs if packed else 1
    cfg = from_dict(DiffusionRunConfig, {
        "run_name": name, "output_dir": args.out_dir,
        "model": {"preset": args.preset, "recompute": recompute},
        "data": data,
        "train": {"steps": args.steps, "global_batch_size": gbs, "micro_batch_size": 1, "lr": args.lr,
                  "min_lr": args.lr, "warmup_steps": 0, "seed": args.seed, "precision": "bf16" if gpu else "fp32",
                  "compile": compile_, "log_interval": 1, "eval_interval": 0, "eval_iters": 0, "save_final": False,
                  "progress": False, "resume": "none"},
        "parallel": {"fsdp": "full"},
        "precision": {"fp8": fp8},
    })
    result = run(cfg)
    recs = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "train_loss" in r]
    # a step's wall time: between consecutive records (train.log_interval=1; each written after the step's sync)
    step_s = statistics.median(b["time"] - a["time"] for a, b in zip(recs[args.warmup - 1:], recs[args.warmup:],
                                                                      strict=False))
    recs = recs[args.warmup:]
    wan = wan_preset(args.preset)
    if packed:  # each step's clips, as the task's sample stream draws them
        from loong.diffusion.data.synthetic import MovingShapes

        shapes = MovingShapes(num_clips=16, num_classes=4, channels=wan.out_channels, frames=args.frames,
                              height=args.height, width=args.width, text_len=args.text_len, text_dim=wan.text_dim,
                              seed=0, sizes=[tuple(s) for s in _sizes(args.packed_sizes)])
        first = args.warmup
        tokens_of_clips = [clip_tokens(shapes.size_of(i), wan.patch_size)
                       for i in range(first * gbs, args.steps * gbs)]
        per_step = sum(tokens_of_clips) / (args.steps - first)
        flops = _step_flops(wan, tokens_of_clips) / (args.steps - first)
    else:
        per_step = clip_tokens([args.frames, args.height, args.width], wan.patch_size)
        flops = _step_flops(wan, [per_step])
    mem = max(r["peak_memory_gib"] for r in recs) if "peak_memory_gib" in recs[0] else None
    print(json.dumps({"s_per_step": round(step_s, 4), "tokens_per_s": round(per_step / step_s, 1),
                      "mfu": round(flops / step_s / PEAK_BF16, 4) if gpu else None, "peak_memory_gib": mem,
                      "loss_last": recs[-1]["train_loss"], "tokens_per_step": per_step}))


def _row(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    worker = "--diffusers-worker" if name.startswith("diffusers") else "--loong-worker"
    passed = ("preset", "frames", "height", "width", "text_len", "steps", "warmup", "lr", "seed", "pack_tokens",
              "packed_gbs")
    cmd = [sys.executable, __file__, f"{worker}={name}", f"--out-dir={tmp}",
           *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in passed],
           "--packed-sizes", *args.packed_sizes]
    t0 = time.time()
    proc = run_child(cmd)
    if proc.returncode:
        tail = proc.stderr[-3000:]
        return {"error": "out of memory" if "OutOfMemoryError" in tail else tail, "command": " ".join(cmd[1:])}
    return {"command": " ".join(cmd[1:]), **json.loads(proc.stdout.strip().splitlines()[-1]),
            "wall_s": round(time.time() - t0, 1)}


def _table(rows: dict[str, dict]) -> list[str]:
    ok = [r["tokens_per_s"] for k, r in rows.items() if k.startswith("diffusers") and "tokens_per_s" in r]
    base = max(ok) if ok else None
    lines = [f"{'row':<44}{'s/step':>8}{'tokens/s':>11}{'MFU':>8}{'peak GiB':>10}{'loss':>9}{'vs diffusers':>14}"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"{ROWS[name]:<44}  {r['error'].splitlines()[-1][:90]}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") is not None else "-"
        vs = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"{ROWS[name]:<44}{r['s_per_step']:>8.3f}{r['tokens_per_s']:>11,.0f}{mfu:>8}{mem:>10}"
                     f"{r['loss_last']:>9.4f}{vs:>14}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--preset", default="wan2_1_t2v_1_3b")
    p.add_argument("--frames", type=int, default=21, help="latent frames (81 video frames)")
    p.add_argument("--height", type=int, default=60, help="latent rows (480 px)")
    p.add_argument("--width", type=int, default=104, help="latent columns (832 px)")
    p.add_argument("--text-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the medians (at least 1)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--packed-sizes", nargs="+", default=["21x60x104", "21x104x60", "11x60x104", "21x30x52"],
                   help="latent FxHxW sizes of the packed row's clips (each clip draws one)")
    p.add_argument("--pack-tokens", type=int, default=32760, help="video tokens per packed micro-batch")
    p.add_argument("--packed-gbs", type=int, default=4, help="clips per step of the packed row")
    p.add_argument("--out", default=None, help="JSON path (default: results/wan_throughput_<gpu>_<date>.json)")
    p.add_argument("--diffusers-worker", default=None, choices=[r for r in ROWS if r.startswith("diffusers")],
                   help=argparse.SUPPRESS)
    p.add_argument("--loong-worker", default=None, choices=list(LOONG_ROWS), help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.diffusers_worker:
        _diffusers_worker(args)
        return
    if args.loong_worker:
        _loong_worker(args)
        return
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (a Loong step's time is measured from the previous step's record)")
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup} to time")
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.rows:
            print(f"running {name} ...", flush=True)
            rows[name] = _row(name, args, Path(tmp))
            r = rows[name]
            print(f"  {name}: " + (f"{r['tokens_per_s']:,.0f} tokens/s, {r['s_per_step']:.3f} s/step"
                                   if "tokens_per_s" in r else r["error"].splitlines()[-1][:200]), flush=True)
    lines = _table(rows)
    command = " ".join(["python", "benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]])
    print("\n" + f"{args.preset}: latent {args.frames}x{args.height}x{args.width}, text {args.text_len} tokens, "
          f"{args.steps} steps (medians after {args.warmup})\n" + "\n".join(lines))
    hw = host()
    tag = (hw.get("gpu") or "cpu").split()[-1].lower()
    out = Path(args.out or RESULTS / f"wan_throughput_{tag}_{time.strftime('%Y%m%d')}.json")
    result = {"benchmark": "wan_throughput", "date": time.strftime("%Y-%m-%d"), "command": command,
              "args": {k: v for k, v in vars(args).items() if not k.endswith("worker") and k != "out_dir"},
              "versions": versions(["torch", "diffusers", "transformers", "triton", "loong-core", "loong-kernels",
                                    "loong-diffusion"]),
              "hardware": hw, "table": lines, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
