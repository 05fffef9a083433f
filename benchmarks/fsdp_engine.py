"""The fsdp engine on one GPU: HF's LlamaForCausalLM trained by it (eager, compiled, fused kernels) beside HF's own
loop and the megatron engine.

Every row trains the ~1B LLaMA shape of ``llm_throughput.py`` (default: the ``llama3_2_1b`` preset, tied
embeddings) on the same data in the same order (loong-llm's tokenised corpus, its seeded ``GlobalBatchSampler``;
``--data stdlib`` as there), with the same AdamW, warm-up + cosine learning rate, weight decay and clipping, each in
its own process (clean memory statistics). Rows:

- ``hf_eager``: llm_throughput's HF row (``LlamaForCausalLM``, SDPA, fp32 weights under bf16 autocast, its own loop);
- ``loong_megatron``: ``loong-llm train`` (llm_throughput's ``loong_bf16``: megatron-core, loong-kernels' fused
  kernels where available);
- ``fsdp_eager``: the HF row's very model (``llm_throughput.hf_model``: same config, seed and weights) trained by
  loong-core's fsdp engine through ``loong.core.run.run`` (``benchmarks/_fsdp_hf_task.py``: the same windows in the
  same order, the same loss); FSDP2 over one GPU, bf16 mixed precision (bf16 compute and residual stream, fp32
  master weights and gradient reduction; where HF's autocast keeps an fp32 residual stream), ``train.compile`` off;
- ``fsdp_compile``: the same with ``train.compile=true`` (``torch.compile`` per decoder layer);
- ``fsdp_kernels``: ``fsdp_eager`` with loong-kernels' fused RMSNorm, SwiGLU, RoPE and linear + cross-entropy swapped
  in where the accelerator reports ``triton`` (``model.fused_kernels=auto``; ``loong.llm.hf_fused``: module
  replacement, HF's parameter names and values);
- ``fsdp_kernels_compile``: the same with ``train.compile=true`` (the kernels inside a compiled layer are opaque to
  inductor, which fuses HF's own norms and activations itself in ``fsdp_compile``; the fused loss sits in the
  uncompiled head either way). The engine's report of torch.compile's graph breaks goes into the row's ``log``.

Columns: tokens/s and MFU (medians after ``--warmup`` steps; MFU with llm_throughput's FLOP formula against the
GPU's dense bf16 peak, 989 TFLOP/s on an H200), peak device memory, the training loss at the last step and the mean
of the last 20. The fsdp rows' tokens/s and peak memory are the trainer's per-step figures from the run's
``metrics.jsonl`` (``train.log_interval=1``: each step's wall time to a device sync, as the megatron row's and the HF
loop's). Prints a table, writes JSON (command, versions, hardware, figures, every row's loss curve) and a loss-curve
PNG to ``benchmarks/results/``.

    python benchmarks/fsdp_engine.py                       # every row, 50 steps (estimated 6-7 min on an H200)
    python benchmarks/fsdp_engine.py --rows fsdp_eager fsdp_compile --steps 100
    python benchmarks/fsdp_engine.py --preset tiny --seq 128 --mbs 2 --gbs 4 --steps 3 --warmup 1 --data shipped \\
        --rows hf_eager fsdp_eager fsdp_kernels --kernels-reference      # CPU smoke check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _env import host, run_child, versions  # benchmarks/_env.py (run as scripts from the repo root)
from llm_throughput import (
    PEAK_BF16,
    RESULTS,
    SETTINGS,
    _hf,
    _loong,
    _loss_summary,
    _plot,
    add_settings,
    llm_config,
    run_rows,
    settings_line,
    table,
)

ROWS: dict[str, str] = {
    "hf_eager": "HF transformers loop, eager",
    "loong_megatron": "Loong megatron engine",
    "fsdp_eager": "fsdp engine, HF model",
    "fsdp_compile": "fsdp engine + compile",
    "fsdp_kernels": "fsdp engine + loong-kernels",
    "fsdp_kernels_compile": "fsdp + loong-kernels + compile",
}
#: fsdp row -> (loong-kernels' fused modules, train.compile)
FSDP_ROWS = {"fsdp_eager": (False, False), "fsdp_compile": (False, True), "fsdp_kernels": (True, False),
             "fsdp_kernels_compile": (True, True)}
LOG_PREFIXES = ("hf_fused:", "train.compile:")  # lines of an fsdp row's output kept in its JSON


def _fsdp_worker(args: argparse.Namespace) -> None:
    """One fsdp row through ``loong.core.run.run`` in this process; prints one JSON line."""
    import torch
    from _fsdp_hf_task import HFLlamaRunConfig

    from loong.core.config import from_dict, to_dict
    from loong.core.run import run
    from loong.llm.models.config import training_flops_per_token

    kernels, compile_ = FSDP_ROWS[args.fsdp_worker]
    base = llm_config(args.preset, args.seed)
    gpu = torch.cuda.is_available()
    d = base.data
    cfg = from_dict(HFLlamaRunConfig, {
        "run_name": args.fsdp_worker, "output_dir": args.out_dir,
        "model": {**to_dict(base.model), "fused_kernels": "auto" if kernels else "off", "recompute": "none"},
        "fused_reference": kernels and args.kernels_reference,
        "data": {"path": args.data_path, "format": d.format, "text_field": d.text_field,
                 "valid_fraction": d.valid_fraction},
        "train": {"steps": args.steps, "seq_length": args.seq, "global_batch_size": args.gbs,
                  "micro_batch_size": args.mbs, "lr": args.lr, "min_lr": args.min_lr, "warmup_steps": args.lr_warmup,
                  "seed": args.seed, "precision": "bf16" if gpu else "fp32", "compile": compile_,
                  "log_interval": 1, "eval_interval": 0, "eval_iters": 0, "save_final": False, "progress": False,
                  "resume": "none"},
        "parallel": {"fsdp": "full"},
    })
    result = run(cfg)
    recs = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "train_loss" in r]
    tok_s = statistics.median(r["tokens_per_s"] for r in recs[args.warmup:])
    mfu = tok_s * training_flops_per_token(base.model, args.seq) / PEAK_BF16 if gpu else None
    mem = max(r["peak_memory_gib"] for r in recs) if "peak_memory_gib" in recs[0] else None
    print(json.dumps({"tokens_per_s": round(tok_s, 1), "mfu": None if mfu is None else round(mfu, 4),
                      "peak_memory_gib": mem, **_loss_summary([r["train_loss"] for r in recs])}))


def _fsdp(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    """An fsdp row in its own process (this file as ``--fsdp-worker``)."""
    cmd = [sys.executable, __file__, f"--fsdp-worker={name}", f"--out-dir={tmp}",
           *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (*SETTINGS, "warmup")],
           *([f"--data-path={args.data_path}"] if args.data_path else []),
           *(["--kernels-reference"] if args.kernels_reference else [])]
    t0 = time.time()
    proc = run_child(cmd)
    if proc.returncode:
        return {"error": proc.stderr[-3000:], "command": " ".join(cmd[1:])}
    lines = proc.stdout.strip().splitlines()
    return {"command": " ".join(cmd[1:]), **json.loads(lines[-1]), "wall_s": round(time.time() - t0, 1),
            "log": [x for x in lines if x.startswith(LOG_PREFIXES)]}


def _run_row(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    if name == "hf_eager":
        return _hf(args, compile_=False)
    if name == "loong_megatron":  # llm_throughput's loong_bf16 row
        return _loong(args, tmp, ("model.fused_kernels=auto", f"train.seed={args.seed}"), run_name=name)
    return _fsdp(name, args, tmp)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_settings(p, steps=50, lr_warmup=10,
                 steps_help="training steps per row (50: every row in an estimated 6-7 min on an H200)")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--kernels-reference", action="store_true",
                   help="the fsdp_kernels rows swap the fused modules in with the kernels' plain-PyTorch references, "
                        "also where Triton is missing (a CPU check of the wiring; no speed-up)")
    p.add_argument("--out", default=None, help="JSON path (default: results/fsdp_engine_<gpu>_<date>.json)")
    p.add_argument("--fsdp-worker", default=None, choices=list(FSDP_ROWS), help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fsdp_worker:
        _fsdp_worker(args)
        return
    if args.gbs % args.mbs:
        p.error(f"--gbs {args.gbs} is not a multiple of --mbs {args.mbs}")
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup} to time")
    if args.lr_warmup >= args.steps:  # the engines then clip the warm-up to steps - 1 (megatron's rule), HF's loop not
        p.error(f"--lr-warmup {args.lr_warmup} must be below --steps {args.steps}")
    rows: dict[str, dict] = {}
    corpus = run_rows(args, _run_row, rows)
    rows = {k: rows[k] for k in ROWS if k in rows}
    command = " ".join(["python", "benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]])
    lines = table(rows, ROWS, {"vs HF": "hf_eager", "vs megatron": "loong_megatron"})
    print(f"\n{settings_line(args)}\n" + "\n".join(lines))
    for name, r in rows.items():
        for line in r.get("log", []):
            print(f"{name}: {line}")
    hw = host()
    tag = (hw.get("gpu") or "cpu").split()[-1].lower()
    out = Path(args.out or RESULTS / f"fsdp_engine_{tag}_{time.strftime('%Y%m%d')}.json")
    result = {"benchmark": "fsdp_engine", "date": time.strftime("%Y-%m-%d"), "command": command,
              "args": {k: v for k, v in vars(args).items() if k not in ("fsdp_worker", "out_dir", "data_path")},
              "corpus": corpus,
              "versions": versions(["torch", "megatron-core", "transformers", "triton", "loong-core",
                                    "loong-kernels", "loong-llm"]),
              "hardware": hw, "table": lines, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    _plot({ROWS[k]: v for k, v in rows.items()}, out.with_suffix(".png"))  # labels, not row keys, in the legend
    print(f"wrote {out} and {out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
