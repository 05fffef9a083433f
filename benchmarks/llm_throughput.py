"""LLM training throughput on one GPU: Hugging Face transformers (eager, compiled, + Liger) and torchtitan against
Loong (bf16, FP8).

Every row trains a model of the same shape: loong-llm's preset ``--preset`` (default ``llama3_2_1b``, 1.24B
parameters, tied embeddings; also e.g. ``qwen3_1_7b``, or the 8B-class ``--preset llama3_8b --num-layers 8``:
llama3_8b's widths with 8 of its 32 layers, so one GPU holds it with AdamW), on the same data, tokenised by
loong-llm's tiny BPE, in the same sample order (loong-llm's seeded sampler), with the same AdamW, warm-up +
cosine learning rate, weight decay and gradient clipping, each in its own process (clean memory statistics). The
data (``--data``):

- ``stdlib`` (default): the Python standard library's own source (``*.py`` outside test folders, sorted
  by path; about 12 MB), one document per file. It is on every machine, so nothing is downloaded, and it
  is large enough that 200 steps of 16K tokens stay inside one epoch: loss curves are smooth and a
  perturbation (FP8 rounding, a nondeterministic kernel) does not send them apart.
- ``shipped``: the small corpus loong-llm ships (about 37 windows of 4096 tokens). 200 steps are about 20
  epochs of it; two identical bf16 runs end 7% apart there (docs/performance.md).

Rows:

- ``hf_eager``: the preset family's HF model (``LlamaForCausalLM``; ``Qwen3ForCausalLM`` with its q/k norms for
  ``family: qwen3``; ``hf_model``) with SDPA attention, fp32 weights under bf16 autocast, fused AdamW
  (what ``Trainer(bf16=True)`` does); ``hf_compile``: the same model under ``torch.compile``.
- ``hf_liger``: the same model with liger-kernel's ``apply_liger_kernel_to_<family>`` (RoPE, RMSNorm, SwiGLU, fused
  linear + cross-entropy) applied before it is built, its loss from Liger's fused forward (``_llm_peers.py``), eager.
- ``torchtitan``: torchtitan 0.3.0's own model of the shape, its one-GPU parallelize (per-block ``torch.compile``,
  selective activation checkpointing, FSDP2 mixed precision), chunked loss, CUDA graphs (its Trainer's defaults),
  in our loop (``_llm_peers.py`` says why). On torch 2.11 torchtitan 0.3.0 does not import (it is built against a
  PyTorch nightly): the row keeps that error. ``torchtitan_compat``: the same after ``_llm_peers.titan_compat``
  stands in for the three nightly-only names torchtitan's dense one-GPU path touches (listed in the row's JSON).
  If the run with CUDA graphs fails, it is run again without them (the first error kept in the row).
- ``loong_bf16``: ``loong-llm train`` (megatron-core, loong-kernels' fused kernels where available);
  ``loong_fp8_<recipe>``: the same with ``precision.fp8=<recipe>`` (docs/fp8.md); ``loong_fp8_tensorwise_output``:
  tensorwise with ``precision.fp8_output_layer=true`` (the output layer's logits and input-gradient GEMMs in FP8).

Columns: tokens/s and MFU (medians after ``--warmup`` steps; MFU against the GPU's dense bf16 peak,
989 TFLOP/s on an H200), peak device memory, and the training loss at the last step (plus the mean of the
last 20 steps, the steadier figure). Prints a table, writes JSON (command, versions, hardware, figures,
every row's loss curve) and a loss-curve PNG to ``benchmarks/results/``; tokens/s against HF eager, HF + Liger,
torchtitan and Loong bf16. The peers' wheels: ``benchmarks/llm_peer_wheels.txt``. With no GPU the HF and torchtitan
rows run on the CPU (fp32, no compile, no CUDA graphs; ``--preset tiny`` for a smoke test).

    python benchmarks/llm_throughput.py                                   # all rows, 200 steps
    python benchmarks/llm_throughput.py --rows hf_eager hf_compile loong_bf16
    python benchmarks/llm_throughput.py --rows loong_fp8_tensorwise --merge results/llm_throughput_h200_<date>.json
    python benchmarks/llm_throughput.py --rows loong_bf16 --profile 50 52 # + torch.profiler table per Loong row
    python benchmarks/llm_throughput.py --preset qwen3_1_7b --rows hf_eager hf_liger torchtitan_compat loong_bf16
    python benchmarks/llm_throughput.py --preset llama3_8b --num-layers 8 --mbs 2 --gbs 8 --steps 40

``--merge`` adds this run's rows to an earlier result file (same settings required), so the rows can be
measured in several shorter sessions and still land in one table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from _env import host, run_child, versions  # benchmarks/_env.py (run as scripts from the repo root)

if TYPE_CHECKING:  # the parent process imports neither torch nor loong: each row's child does
    import torch
    from transformers import PreTrainedModel

    from loong.core.config.schema import DataConfig
    from loong.llm.data.text import GlobalBatchSampler, PackedTokens
    from loong.llm.models.config import DenseModelConfig
    from loong.llm.schema import LLMRunConfig

RESULTS = Path(__file__).parent / "results"
PEAK_BF16 = 989e12  # H200/H100 SXM dense bf16, the denominator MFU figures in this field use
FP8_RECIPES = ("tensorwise", "rowwise", "blockwise", "adaptive")
ROWS: dict[str, str] = {
    "hf_eager": "HF transformers, eager (SDPA)",
    "hf_compile": "HF transformers + torch.compile",
    "hf_liger": "HF transformers + Liger kernels",
    "torchtitan": "torchtitan 0.3.0",
    "torchtitan_compat": "torchtitan 0.3.0 (compat)",
    "loong_bf16": "Loong bf16",
    **{f"loong_fp8_{r}": f"Loong FP8 {r}" for r in FP8_RECIPES},
    "loong_fp8_tensorwise_output": "Loong FP8 tensorwise + output layer",
}
SETTINGS = ("preset", "seq", "mbs", "gbs", "steps", "lr", "min_lr", "lr_warmup", "data", "seed")
BASELINES = {"vs HF": ("hf_eager",), "vs Liger": ("hf_liger",), "vs titan": ("torchtitan", "torchtitan_compat"),
             "vs bf16": ("loong_bf16",)}  # a column per baseline: the first of its rows that ran


def stdlib_corpus(out: Path) -> dict:
    """Write the Python standard library's source as JSONL (one file per line, sorted); returns its facts."""
    import hashlib
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py")
                   if not {"test", "tests", "idle_test", "site-packages"} & set(f.relative_to(root).parts))
    digest = hashlib.sha256()
    with out.open("w") as fh:
        for f in files:
            text = f.read_text(encoding="utf-8", errors="replace")
            digest.update(text.encode())
            fh.write(json.dumps({"text": text}) + "\n")
    return {"source": str(root), "files": len(files), "bytes": out.stat().st_size, "sha256": digest.hexdigest()}


def _loss_summary(losses: list[float]) -> dict:
    tail = losses[-20:]
    return {"loss_last": losses[-1], "loss_last20_mean": sum(tail) / len(tail), "losses": losses}


def _loong(args: argparse.Namespace, out: Path, overrides: tuple[str, ...] = (), run_name: str = "loong") -> dict:
    """One ``loong-llm train`` run in its own process; medians over the steps after ``args.warmup``."""
    cmd = [sys.executable, "-m", "loong.llm.cli", "train", f"model={args.preset}",
           f"train.seq_length={args.seq}", f"train.micro_batch_size={args.mbs}",
           f"train.global_batch_size={args.gbs}", f"train.steps={args.steps}", "train.eval_iters=0",
           "train.eval_interval=0", "train.progress=false", "train.save_final=false",
           f"train.lr={getattr(args, 'lr', 3e-4)}", f"train.min_lr={getattr(args, 'min_lr', 3e-5)}",
           f"train.warmup_steps={getattr(args, 'lr_warmup', 5)}", f"output_dir={out}", f"run_name={run_name}",
           *([f"data.path={args.data_path}"] if getattr(args, "data_path", None) else []), *overrides]
    t0 = time.time()
    proc = run_child(cmd)
    if proc.returncode:
        return {"error": proc.stderr[-3000:], "command": " ".join(cmd)}
    recs = [json.loads(x) for x in (out / run_name / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "train_loss" in r]
    timed = recs[args.warmup:]
    row = {
        "command": "loong-llm " + " ".join(cmd[3:]),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed) if "mfu" in timed[0] else None,
        "peak_memory_gib": max(r["peak_memory_gib"] for r in recs) if "peak_memory_gib" in recs[0] else None,
        "loss_first_last": [recs[0]["train_loss"], recs[-1]["train_loss"]],
        **_loss_summary([r["train_loss"] for r in recs]),
        "wall_s": round(time.time() - t0, 1),
    }
    plan: list[str] = []  # the run's FP8 plan: "fp8: ..." and its indented per-layer lines
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith("fp8") or (plan and line.startswith("  ") and len(plan) < 16):
            plan.append(line)
    if plan:
        row["fp8_log"] = plan
    ops = out / run_name / "profile" / "ops.txt"
    if ops.exists():
        row["profile_ops"] = ops.read_text().splitlines()[:30]
    return row


def _lr(step: int, args: argparse.Namespace) -> float:
    """megatron-core's OptimizerParamScheduler as Loong configures it: linear warm-up from 0 (the first
    update uses step 0), then cosine to ``min_lr`` at ``steps``."""
    if args.lr_warmup and step <= args.lr_warmup:
        return args.lr * step / args.lr_warmup
    ratio = (step - args.lr_warmup) / max(args.steps - args.lr_warmup, 1)
    return args.min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (args.lr - args.min_lr)


def llm_config(preset: str, seed: int, num_layers: int | None = None) -> LLMRunConfig:
    """loong-llm's pretraining config of ``preset`` (``LLMRunConfig``) with ``train.seed=seed`` (and
    ``model.num_layers=num_layers`` where given): the model shape and data settings every HF-model row reads."""
    from loong.core.config import compose_config
    from loong.llm.schema import LLMRunConfig

    overrides = [f"model={preset}", f"train.seed={seed}", *([f"model.num_layers={num_layers}"] if num_layers else [])]
    cfg, _ = compose_config("loong.llm.configs", "pretrain", overrides, LLMRunConfig)
    return cfg


def hf_model(m: DenseModelConfig, seed: int) -> PreTrainedModel:
    """The HF causal LM of loong-llm's model config ``m``, of its family (``LlamaForCausalLM``, ``Qwen3ForCausalLM``
    with q/k norms, ...: the class and config.json loong-llm's HF mapping names, tying as ``m`` says), SDPA
    attention, fp32 on the host, its weights drawn after ``torch.manual_seed(seed)`` (so every row that builds it
    starts from the same weights). Liger's entry point, where used, must run before this."""
    import torch
    import transformers

    from loong.llm.models.hf_mapping import family_by_name

    family = family_by_name(m.family)
    d = family.hf_config_dict(m)
    for k in ("architectures", "model_type", "dtype", "torch_dtype", "use_cache"):
        d.pop(k)
    hf_cfg = transformers.AutoConfig.for_model(family.model_type, **d, attn_implementation="sdpa")
    cls = getattr(transformers, family.architectures[0])
    torch.manual_seed(seed)
    return cls(hf_cfg).train()


def corpus_windows(d: DataConfig, data_path: str | None, seq: int, seed: int
                   ) -> tuple[PackedTokens, PackedTokens, GlobalBatchSampler]:
    """loong-llm's tokenised corpus (``data_path``, else the packaged one) as ``(train, valid, sampler)``: windows of
    ``seq + 1`` tokens split by the data config ``d``, and the seeded order in which loong-llm reads them."""
    from loong.llm.data.text import GlobalBatchSampler, split_stream, tokenize_corpus
    from loong.llm.data.tokenizer import load_tokenizer, packaged_corpus_path

    path = Path(data_path) if data_path else packaged_corpus_path()
    tokens = tokenize_corpus(path, load_tokenizer(None), d.format, d.text_field)
    train, valid = split_stream(tokens, seq, d.valid_fraction, str(path))
    return train, valid, GlobalBatchSampler(len(train), seed)


def microbatch(windows: PackedTokens, sampler: GlobalBatchSampler, first: int, mbs: int) -> dict[str, torch.Tensor]:
    """Samples ``first .. first + mbs - 1`` of the run's order as one micro-batch (``tokens``, ``labels``, ...)."""
    from loong.llm.data.text import make_microbatch

    return make_microbatch([windows[sampler.index(g)] for g in range(first, first + mbs)])


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The rows' loss: mean next-token cross-entropy, in fp32, over every token of the micro-batch."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _hf_worker(args: argparse.Namespace) -> None:
    """The HF model (``--liger``: with Liger's kernels) on loong-llm's data in loong-llm's order; prints one JSON
    line."""
    import torch

    from loong.llm.models.config import training_flops_per_token

    cfg = llm_config(args.preset, args.seed, args.num_layers)
    m = cfg.model
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    liger = None
    if args.liger:
        from _llm_peers import use_liger

        liger = use_liger(m.family)
    model = hf_model(m, cfg.train.seed).to(device)
    forward = torch.compile(model) if args.compile else model
    decay = [p for p in model.parameters() if p.ndim >= 2]  # megatron: no decay on norms and biases
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=gpu)

    train, _, sampler = corpus_windows(cfg.data, args.data_path, args.seq, cfg.train.seed)
    accum = args.gbs // args.mbs
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    tps, losses = [], []
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, args)
        sync()
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for i in range(accum):
            mb = microbatch(train, sampler, step * args.gbs + i * args.mbs, args.mbs)
            ids, labels = mb["tokens"].to(device), mb["labels"].to(device)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=gpu):
                if liger:  # labels already shifted: Liger's fused linear + cross-entropy, mean over the tokens
                    loss = forward(input_ids=ids, shift_labels=labels).loss
                else:
                    logits = forward(input_ids=ids).logits
            if not liger:
                loss = lm_loss(logits, labels)
            (loss / accum).backward()
            total += loss.detach() / accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))  # the host sync a logging trainer makes every step too
        tps.append(args.gbs * args.seq / (time.perf_counter() - t0))
    tok_s = statistics.median(tps[args.warmup:])
    mfu = tok_s * training_flops_per_token(m, args.seq) / PEAK_BF16 if gpu else None
    mem = round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None
    print(json.dumps({"tokens_per_s": round(tok_s, 1), "mfu": None if mfu is None else round(mfu, 4),
                      "peak_memory_gib": mem, "model_class": type(model).__name__,
                      **({"liger_entry_point": liger} if liger else {}), **_loss_summary(losses)}))


def _worker(args: argparse.Namespace, flags: list[str]) -> dict:
    """This file as a worker (``flags``: ``--hf-worker`` or ``--titan-worker`` and its switches) in its own process,
    with the run's settings; its JSON line as a row, or the error (the end of its stderr) and the command."""
    cmd = [sys.executable, __file__, *flags,
           *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (*SETTINGS, "warmup")],
           *([f"--num-layers={args.num_layers}"] if getattr(args, "num_layers", None) else []),
           *([f"--data-path={args.data_path}"] if args.data_path else [])]
    t0 = time.time()
    proc = run_child(cmd)
    if proc.returncode:
        return {"error": proc.stderr[-3000:], "command": " ".join(cmd[1:]), "stdout": proc.stdout[-2000:]}
    return {"command": " ".join(cmd[1:]), **json.loads(proc.stdout.strip().splitlines()[-1]),
            "wall_s": round(time.time() - t0, 1)}


TITAN_GRAPHS = "torchtitan: training with CUDA graphs"  # the torchtitan worker's line before its first step


def _hf(args: argparse.Namespace, compile_: bool, liger: bool = False) -> dict:
    """An HF row in its own process (``compile_``: under ``torch.compile``; ``liger``: with Liger's kernels)."""
    return _worker(args, ["--hf-worker", *(["--compile"] if compile_ else []), *(["--liger"] if liger else [])])


def _titan(args: argparse.Namespace, compat: bool, tmp: Path) -> dict:
    """A torchtitan row in its own process; run again without CUDA graphs if the run with them fails."""
    flags = ["--titan-worker", f"--titan-dump={tmp / 'torchtitan'}", *(["--titan-compat"] if compat else []),
             *([f"--titan-loss={args.titan_loss}"] if args.titan_loss else [])]
    row = _worker(args, flags)
    if "error" in row and TITAN_GRAPHS in row.pop("stdout"):  # it failed with CUDA graphs on
        again = _worker(args, [*flags, "--titan-no-cuda-graphs"])
        again.pop("stdout", None)
        return {**again, "cuda_graphs_error": row["error"]}
    return row


def _run_row(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    if name.startswith("hf_"):
        return _hf(args, compile_=name == "hf_compile", liger=name == "hf_liger")
    if name.startswith("torchtitan"):
        return _titan(args, compat=name == "torchtitan_compat", tmp=tmp)
    overrides = ["model.fused_kernels=auto", f"train.seed={args.seed}",
                 *([f"model.num_layers={args.num_layers}"] if args.num_layers else [])]
    if name == "loong_fp8_tensorwise_output":
        overrides += ["precision.fp8=tensorwise", "precision.fp8_output_layer=true"]
    elif name.startswith("loong_fp8_"):
        overrides.append(f"precision.fp8={name.removeprefix('loong_fp8_')}")
    if args.profile:
        overrides.append(f"train.profile_steps=[{args.profile[0]},{args.profile[1]}]")
    return _loong(args, tmp, tuple(overrides), run_name=name)


def table(rows: dict[str, dict], labels: dict[str, str], baselines: dict[str, str | tuple[str, ...]]) -> list[str]:
    """The rows' table: label, tokens/s, MFU, peak memory, the last and the last-20 loss, and tokens/s against each
    baseline row (``{"vs HF": "hf_eager"}``: a column per baseline, ``-`` where that row is missing or failed; a
    tuple of rows: the first of them that ran)."""
    bases = {title: _first_ok(rows, (names,) if isinstance(names, str) else names)
             for title, names in baselines.items()}
    widths = {title: max(8, len(title) + 2) for title in baselines}
    lines = [f"{'row':<34}{'tokens/s':>10}{'MFU':>8}{'peak GiB':>10}{'loss@end':>10}{'last-20':>9}"
             + "".join(f"{title:>{widths[title]}}" for title in baselines)]
    for name, r in rows.items():
        label = labels.get(name, name)
        if "error" in r:
            err = r["error"].strip().splitlines() or [""]
            err = next((x for x in reversed(err) if "Error" in x), err[-1]).removeprefix("[rank0]: ")
            lines.append(f"{label:<34}  failed: {err[:90]}")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") is not None else "-"
        vs = {title: f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if "tokens_per_s" in b else "-"
              for title, b in bases.items()}
        lines.append(f"{label:<34}{r['tokens_per_s']:>10,.0f}{mfu:>8}{mem:>10}{r['loss_last']:>10.4f}"
                     f"{r['loss_last20_mean']:>9.4f}" + "".join(f"{vs[t]:>{widths[t]}}" for t in baselines))
    return lines


def _first_ok(rows: dict[str, dict], names: tuple[str, ...]) -> dict:
    """The first of ``names`` that is a row of ``rows`` without an error (``{}`` if none)."""
    return next((rows[n] for n in names if n in rows and "error" not in rows[n]), {})


def _targets(rows: dict[str, dict]) -> dict:
    """The issues' targets, checked on whatever rows are present: issue 7's (Loong bf16 against HF eager, FP8 against
    bf16) and issue 26's (Loong bf16 >= 1.5x HF + Liger and >= 1.2x torchtitan; the best Loong row too)."""
    ok = {k: v for k, v in rows.items() if "error" not in v}
    out: dict = {}
    loong = {k: v for k, v in ok.items() if k.startswith("loong_")}
    for key, names, need in (("liger", ("hf_liger",), 1.5), ("torchtitan", ("torchtitan", "torchtitan_compat"), 1.2)):
        peer = next((n for n in names if n in ok), None)
        if peer and "loong_bf16" in ok:
            out[f"bf16_speedup_vs_{key}"] = round(ok["loong_bf16"]["tokens_per_s"] / ok[peer]["tokens_per_s"], 3)
            out[f"bf16_vs_{key}_target_met"] = out[f"bf16_speedup_vs_{key}"] >= need
        if peer and loong:
            best = max(loong, key=lambda k: loong[k]["tokens_per_s"])
            out[f"best_loong_vs_{key}"] = [best, round(loong[best]["tokens_per_s"] / ok[peer]["tokens_per_s"], 3)]
        if peer:
            out[f"{key}_row"] = peer
    hf, bf16 = ok.get("hf_eager"), ok.get("loong_bf16")
    if hf and bf16:
        out["bf16_speedup_vs_hf_eager"] = round(bf16["tokens_per_s"] / hf["tokens_per_s"], 3)
        if bf16["peak_memory_gib"] and hf["peak_memory_gib"]:  # device memory (not measured on CPU)
            out["bf16_memory_vs_hf_eager"] = round(bf16["peak_memory_gib"] / hf["peak_memory_gib"], 3)
            out["bf16_target_met"] = out["bf16_speedup_vs_hf_eager"] >= 1.35 and out["bf16_memory_vs_hf_eager"] <= 0.7
    fp8 = {k: v for k, v in ok.items() if k.startswith("loong_fp8_")}
    if bf16 and fp8:
        best = max(fp8, key=lambda k: fp8[k]["tokens_per_s"])
        out["fp8_best"] = best
        out["fp8_speedup_vs_bf16"] = round(fp8[best]["tokens_per_s"] / bf16["tokens_per_s"], 3)
        out["fp8_loss_rel_diff"] = {k: round(v["loss_last20_mean"] / bf16["loss_last20_mean"] - 1, 5)
                                   for k, v in fp8.items()}
        out["fp8_target_met"] = out["fp8_speedup_vs_bf16"] >= 1.3 and abs(out["fp8_loss_rel_diff"][best]) <= 0.005
    return out


def _plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in rows.items():
        if "losses" in r:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=ROWS.get(name, name), linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_rows(args: argparse.Namespace, run_row: Callable[[str, argparse.Namespace, Path], dict],
             rows: dict[str, dict]) -> dict | None:
    """Run ``args.rows`` one after another (``run_row(name, args, tmp)``, each in its own process) into ``rows``, on
    the corpus ``--data`` names (``stdlib``: written to a temporary folder first, ``args.data_path`` set); returns
    the corpus' facts (None for the shipped corpus)."""
    corpus = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.data == "stdlib":
            args.data_path = str(Path(tmp) / "stdlib.jsonl")
            corpus = stdlib_corpus(Path(args.data_path))
            print(f"data: {corpus['files']} files of the Python standard library, {corpus['bytes'] / 1e6:.1f} MB")
        for name in args.rows:
            print(f"running {name} ...", flush=True)
            r = rows[name] = run_row(name, args, Path(tmp))
            print(f"  {name}: " + (f"{r['tokens_per_s']:,.0f} tokens/s, {r['wall_s']} s" if "error" not in r
                                   else "failed"), flush=True)
    return corpus


def settings_line(args: argparse.Namespace) -> str:
    """The table's heading: the shape and batch every row ran."""
    layers = f" ({args.num_layers} layers)" if getattr(args, "num_layers", None) else ""
    return (f"{args.preset}{layers}  seq={args.seq} micro-batch={args.mbs} global-batch={args.gbs} steps={args.steps} "
            f"(tokens/s: median after step {args.warmup})")


def add_settings(p: argparse.ArgumentParser, steps: int = 200, lr_warmup: int = 20, steps_help: str | None = None
                 ) -> None:
    """The run settings every row shares (``SETTINGS``, ``--warmup``, ``--data-path``), with these defaults."""
    p.add_argument("--preset", default="llama3_2_1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--gbs", type=int, default=4)
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr", type=float, default=3e-5)
    p.add_argument("--lr-warmup", type=int, default=lr_warmup, help="learning-rate warm-up steps")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput figures")
    p.add_argument("--data", choices=["stdlib", "shipped"], default="stdlib",
                   help="stdlib: the Python standard library's source; shipped: loong-llm's small corpus "
                        "(llm_throughput.py's docstring)")
    p.add_argument("--data-path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1234, help="initialisation and data-order seed (train.seed)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_settings(p)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--num-layers", type=int, default=None,
                   help="the preset's widths with this many layers (model.num_layers), e.g. llama3_8b with 8")
    p.add_argument("--profile", type=int, nargs=2, metavar=("START", "END"), default=None,
                   help="torch.profiler over these steps of every Loong row; top operators go into the JSON")
    p.add_argument("--merge", default=None, help="an earlier result JSON to add these rows to")
    p.add_argument("--out", default=None, help="JSON path (default: results/llm_throughput_<gpu>_<preset>_<date>.json)")
    for flag in ("--hf-worker", "--compile", "--liger", "--titan-worker", "--titan-compat", "--titan-no-cuda-graphs",
                 "--titan-no-compile"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--titan-dump", default="outputs/torchtitan", help=argparse.SUPPRESS)
    p.add_argument("--titan-loss", choices=["chunked", "ce"], default=None,
                   help="torchtitan rows' loss: its ChunkedLossWrapper (torchtitan's default) or plain "
                        "CrossEntropyLoss (default: chunked for torchtitan, ce for torchtitan_compat; _llm_peers.py "
                        "says why)")
    args = p.parse_args()
    if args.hf_worker:
        _hf_worker(args)
        return
    if args.titan_worker:
        from _llm_peers import titan_worker

        titan_worker(args)
        return
    if args.gbs % args.mbs:
        p.error(f"--gbs {args.gbs} is not a multiple of --mbs {args.mbs}")
    rows: dict[str, dict] = {}
    commands: list[str] = []
    if args.merge:
        earlier = json.loads(Path(args.merge).read_text())
        # files from before --data existed were measured on the shipped corpus
        before = {"data": "shipped", "seed": 1234, "num_layers": None, **earlier["args"]}
        differ = {k: (before[k], getattr(args, k)) for k in (*SETTINGS, "num_layers") if before[k] != getattr(args, k)}
        if differ:
            p.error(f"--merge {args.merge}: settings differ (earlier, now): {differ}")
        rows, commands = earlier["rows"], earlier["commands"]
    corpus = run_rows(args, _run_row, rows)
    rows = {k: rows[k] for k in ROWS if k in rows}
    command = " ".join(["python", "benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]])
    lines = table(rows, ROWS, BASELINES)
    print(f"\n{settings_line(args)}\n" + "\n".join(lines))
    targets = _targets(rows)
    print(json.dumps(targets, indent=1))
    hw = host()
    tag = (hw.get("gpu") or "cpu").split()[-1].lower()
    shape = args.preset + (f"_{args.num_layers}l" if args.num_layers else "")
    out = Path(args.merge or args.out or RESULTS / f"llm_throughput_{tag}_{shape}_{time.strftime('%Y%m%d')}.json")
    result = {"benchmark": "llm_throughput", "date": time.strftime("%Y-%m-%d"), "commands": [*commands, command],
              "args": {k: v for k, v in vars(args).items()
                       if k in (*SETTINGS, "num_layers", "warmup", "rows", "profile", "out")},
              "corpus": corpus or (earlier.get("corpus") if args.merge else None),
              "versions": versions(["torch", "megatron-core", "transformers", "triton", "loong-core",
                                    "loong-kernels", "loong-llm", "liger-kernel", "torchtitan"]),
              "hardware": hw, "table": lines, "targets": targets, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
