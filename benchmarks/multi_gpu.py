"""Multi-GPU layouts on one host: loss agreement with one GPU, throughput, resharded resume, scaling.

Run on a machine with >= 2 GPUs (``python3 benchmarks/multi_gpu.py``). Every run starts from the same
random Hugging Face weights (written once with ``transformers``), trains on the packaged corpus with the
same global batch, and goes through ``loong-llm train`` (``--nproc-per-node`` relaunches through
torchrun). One-GPU runs that do not depend on each other run side by side on different GPUs.

- **~1B** (``llama3_2_1b``): 1 GPU, TP=2, PP=2 with 2 virtual stages, DP=2 — the loss of every step
  against the one-GPU run; tokens/s per GPU, MFU, peak memory.
- **~8B-shaped** (``llama3_8b`` widths, ``--big-layers`` layers so one GPU holds it): 1 GPU and TP=2.
- **Resharded resume:** the TP=2 run saves at step ``--save-at``; it is resumed at PP=2 and on one GPU
  for one step, whose loss is compared with the TP=2 run's own next step.
- **Scaling 1 → 2 GPUs** at a fixed per-GPU batch: DP=2 with twice the global batch of a one-GPU run.
- **MoE** (``--groups moe``): the reduced-layer MoE presets (``qwen3_30b_a3b_4l``, ``deepseek_v3_4l``,
  ``deepseek_v3_2_4l``; random HF weights from each preset's own config.json translation) on one GPU and at
  EP=2 (DP=2 for the dense parts): the loss of every step against the one-GPU run, tokens/s per GPU, memory;
  ``--moe-overrides`` adds settings to every MoE run (e.g. ``model.moe_grouped_mm=true``).

- **Context parallelism** (``--groups cp``): the ~1B (or ``--cp-preset``, e.g. ``deepseek_v3_2_4l``) at
  ``--cp-seq`` (32K) tokens per sequence on one GPU and at CP=2, ``model.recompute=full`` (plus ``--cp-overrides``):
  the loss of every step against the one GPU, tokens/s per GPU, memory.

``--groups`` picks what runs (default: ``dense moe``); ``pp`` is the one-GPU ~1B run and PP=2 × VPP=2 alone
(a re-check of the interleaved pipeline without the rest of ``dense``); ``big`` is the ~8B-shaped model at PP=2 ×
VPP=2 and DP=2 against its one-GPU run.

Prints a table and writes JSON (command, versions, GPUs, every figure) to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _env import host, run_child, versions  # noqa: E402

SHAPES = {  # HF LlamaConfig fields of the two presets (see loong/llm/configs/model/*.yaml)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
               rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=False),
}


def make_hf(shape: str, layers: int | None, out: Path) -> Path:
    """Random bf16 weights in an HF folder (initialised on the GPU: seconds, not minutes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(SHAPES[shape])
    if layers:
        fields["num_hidden_layers"] = layers
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**fields)).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


MOE_PRESETS = ("qwen3_30b_a3b_4l", "deepseek_v3_4l", "deepseek_v3_2_4l")


def make_hf_from_preset(preset: str, out: Path, device: str = "cuda") -> Path:
    """Random bf16 weights for a Loong preset, through its family's config.json translation."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from loong.core.config import compose_config
    from loong.llm.models.hf_mapping import family_by_name
    from loong.llm.schema import LLMRunConfig

    cfg, _ = compose_config("loong.llm.configs", "pretrain", [f"model={preset}"], LLMRunConfig)
    fields = family_by_name(cfg.model.family).hf_config_dict(cfg.model)
    fields.pop("architectures", None)
    hf_cfg = AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def train(name: str, hf: Path, out: Path, args: argparse.Namespace, nproc: int, gpus: str,
          *overrides: str) -> dict:
    """One ``loong-llm train`` run; returns its per-step records and summary."""
    cmd = [sys.executable, "-m", "loong.llm.cli", "train", f"--nproc-per-node={nproc}",
           f"model.init_from_hf={hf}", f"train.seq_length={args.seq}", f"train.micro_batch_size={args.mbs}",
           f"train.global_batch_size={args.gbs}", f"train.steps={args.steps}", "train.eval_iters=0",
           "train.eval_interval=0", "train.save_final=false", "train.progress=false", "train.warmup_steps=5",
           f"output_dir={out}", f"run_name={name}", *overrides]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    started = time.perf_counter()
    proc = run_child(cmd, env=env)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        print(f"{name}: FAILED\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {"name": name, "failed": True, "stderr_tail": proc.stderr[-3000:], "command": cmd}
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train_loss" in r]
    timed = [r for r in steps if r["step"] > args.warmup_skip]
    tps = sum(r["tokens_per_s"] for r in timed) / max(1, len(timed))
    mfu = [r["mfu"] for r in timed if "mfu" in r]
    return {"name": name, "gpus": max(1, nproc), "wall_s": round(wall, 1), "command": cmd,
            "loss": {r["step"]: r["train_loss"] for r in steps},
            "tokens_per_s": round(tps, 1), "tokens_per_s_per_gpu": round(tps / max(1, nproc), 1),
            "mfu": round(sum(mfu) / len(mfu), 4) if mfu else None,
            "peak_memory_gib": max((r.get("peak_memory_gib", 0) for r in steps), default=None)}


def loss_gap(run: dict, ref: dict) -> float | None:
    """Largest |loss difference| over the steps both runs logged."""
    if run.get("failed") or ref.get("failed"):
        return None
    common = set(run["loss"]) & set(ref["loss"])
    return round(max(abs(run["loss"][s] - ref["loss"][s]) for s in common), 5) if common else None


def tail_gap(run: dict, ref: dict, n: int = 10) -> float | None:
    """Mean |loss difference| over the last ``n`` common steps: where two bf16 runs that drifted apart after a
    loss spike (MoE routing flips amplify rounding) have settled, which the largest gap alone does not show."""
    if run.get("failed") or ref.get("failed"):
        return None
    common = sorted(set(run["loss"]) & set(ref["loss"]), key=int)[-n:]
    return round(sum(abs(run["loss"][s] - ref["loss"][s]) for s in common) / len(common), 5) if common else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-at", type=int, default=15)
    p.add_argument("--big-layers", type=int, default=4, help="layers of the ~8B-shaped model")
    p.add_argument("--warmup-skip", type=int, default=5, help="steps left out of the throughput")
    p.add_argument("--work", default="/tmp/loong-multi-gpu")
    p.add_argument("--out", default=None)
    p.add_argument("--groups", nargs="+", choices=["dense", "big", "pp", "moe", "cp"], default=["dense", "moe"])
    p.add_argument("--cp-seq", type=int, default=32768, help="tokens per sequence of the cp group")
    p.add_argument("--cp-gbs", type=int, default=4, help="global batch (sequences) of the cp group")
    p.add_argument("--cp-preset", choices=MOE_PRESETS, default=None,
                   help="the cp group's model: a MoE preset (random HF weights from its config) instead of the ~1B")
    p.add_argument("--cp-overrides", nargs="+", default=[], help="key=value overrides for both cp runs")
    p.add_argument("--moe-presets", nargs="+", choices=MOE_PRESETS, default=list(MOE_PRESETS))
    p.add_argument("--moe-overrides", nargs="+", default=[],
                   help="key=value overrides for every MoE run (e.g. model.moe_grouped_mm=true)")
    args = p.parse_args()

    import torch

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    runs = work / "runs"
    r: dict[str, dict] = {}
    summary: dict = {}
    if "dense" in args.groups:
        summary.update(dense_runs(args, work, runs, r))
    if "pp" in args.groups and "dense" not in args.groups:
        summary.update(pp_runs(args, work, runs, r))
    if "big" in args.groups:
        summary.update(big_runs(args, work, runs, r))
    if "moe" in args.groups:
        summary.update(moe_runs(args, work, runs, r))
    if "cp" in args.groups:
        summary.update(cp_runs(args, work, runs, r))

    print(f"\n{'run':28s} {'GPUs':>4s} {'tok/s/GPU':>10s} {'MFU':>7s} {'peak GiB':>9s} {'max |Δloss| vs 1 GPU':>21s}")
    for name, run in r.items():
        if run.get("failed"):
            print(f"{name:28s} FAILED")
            continue
        ref = r.get(run.get("ref", ""))
        gap = loss_gap(run, ref) if ref is not None and ref is not run else None
        mfu = f"{run['mfu']:.1%}" if run["mfu"] else "-"
        print(f"{name:28s} {run['gpus']:>4d} {run['tokens_per_s_per_gpu']:>10,.0f} {mfu:>7s} "
              f"{run['peak_memory_gib'] or 0:>9.1f} {'-' if gap is None else f'{gap:.4f}':>21s}")
    print(json.dumps(summary, indent=1))
    gpu = torch.cuda.get_device_name().replace(" ", "_").lower() if torch.cuda.is_available() else "nogpu"
    out = Path(args.out or Path(__file__).parent / "results" /
               f"multi_gpu_{gpu}x{torch.cuda.device_count()}_{time.strftime('%Y%m%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "args": vars(args), "host": host(),
                               "versions": versions(["torch", "megatron-core", "transformers", "loong-llm"]),
                               "summary": summary, "runs": r}, indent=1))
    print(f"wrote {out}")


def moe_runs(args: argparse.Namespace, work: Path, runs: Path, r: dict[str, dict]) -> dict:
    """Each MoE preset on one GPU and at EP=2; returns the loss gaps."""
    hfs = {preset: make_hf_from_preset(preset, work / f"hf-{preset}") for preset in args.moe_presets}
    with ThreadPoolExecutor(2) as pool:  # the one-GPU runs two at a time, one per GPU
        ones = {preset: pool.submit(train, f"{preset}-1gpu", hf, runs, args, 1, str(i % 2), *args.moe_overrides)
                for i, (preset, hf) in enumerate(hfs.items())}
        for preset, fut in ones.items():
            r[f"{preset}-1gpu"] = {**fut.result(), "ref": f"{preset}-1gpu"}
    gaps, tails = {}, {}
    for preset, hf in hfs.items():
        one, ep2 = f"{preset}-1gpu", f"{preset}-ep2"
        r[ep2] = {**train(ep2, hf, runs, args, 2, "0,1", "parallel.ep=2", *args.moe_overrides), "ref": one}
        gaps[preset], tails[preset] = loss_gap(r[ep2], r[one]), tail_gap(r[ep2], r[one])
    return {"moe_loss_gap_ep2_vs_1gpu": gaps, "moe_loss_gap_ep2_vs_1gpu_last10_mean": tails}


def pp_runs(args: argparse.Namespace, work: Path, runs: Path, r: dict[str, dict]) -> dict:
    """The ~1B on one GPU and at PP=2 x VPP=2 only; returns the loss gap."""
    hf1 = make_hf("1b", None, work / "hf-1b")
    r["1b-1gpu"] = {**train("1b-1gpu", hf1, runs, args, 1, "0"), "ref": "1b-1gpu"}
    r["1b-pp2-vpp2"] = {**train("1b-pp2-vpp2", hf1, runs, args, 2, "0,1", "parallel.pp=2", "parallel.vpp=2"),
                        "ref": "1b-1gpu"}
    return {"loss_gap_vs_1gpu": {"1b-pp2-vpp2": loss_gap(r["1b-pp2-vpp2"], r["1b-1gpu"])}}


def cp_runs(args: argparse.Namespace, work: Path, runs: Path, r: dict[str, dict]) -> dict:
    """The ~1B (or ``--cp-preset``) at ``--cp-seq`` tokens per sequence on one GPU and at CP=2 (the same global batch
    of whole sequences; full recompute so one GPU holds it, plus ``--cp-overrides``); returns the loss gap."""
    name = args.cp_preset or "1b"
    hf = make_hf_from_preset(name, work / f"hf-{name}") if args.cp_preset else make_hf("1b", None, work / "hf-1b")
    long = argparse.Namespace(**{**vars(args), "seq": args.cp_seq, "mbs": 1, "gbs": args.cp_gbs})
    extra = ("model.recompute=full", *args.cp_overrides)
    one, cp2 = f"{name}-long-1gpu", f"{name}-long-cp2"
    r[one] = {**train(one, hf, runs, long, 1, "0", *extra), "ref": one}
    r[cp2] = {**train(cp2, hf, runs, long, 2, "0,1", "parallel.cp=2", *extra), "ref": one}
    return {"loss_gap_cp2_vs_1gpu": loss_gap(r[cp2], r[one]), "loss_gap_cp2_vs_1gpu_last10_mean": tail_gap(r[cp2], r[one])}


def big_runs(args: argparse.Namespace, work: Path, runs: Path, r: dict[str, dict]) -> dict:
    """The ~8B-shaped model's other two-GPU layouts (``dense`` has its one-GPU and TP=2 runs): PP=2 x VPP=2 and
    DP=2 against one GPU; returns the loss gaps."""
    hf8 = make_hf("8b", args.big_layers, work / "hf-8b")
    r["8b-1gpu"] = {**train("8b-1gpu", hf8, runs, args, 1, "0"), "ref": "8b-1gpu"}
    r["8b-pp2-vpp2"] = {**train("8b-pp2-vpp2", hf8, runs, args, 2, "0,1", "parallel.pp=2", "parallel.vpp=2"),
                        "ref": "8b-1gpu"}
    r["8b-dp2"] = {**train("8b-dp2", hf8, runs, args, 2, "0,1"), "ref": "8b-1gpu"}
    return {"loss_gap_8b_vs_1gpu": {k: loss_gap(r[k], r["8b-1gpu"]) for k in ("8b-pp2-vpp2", "8b-dp2")},
            "loss_gap_8b_vs_1gpu_last10_mean": {k: tail_gap(r[k], r["8b-1gpu"]) for k in ("8b-pp2-vpp2", "8b-dp2")}}


def dense_runs(args: argparse.Namespace, work: Path, runs: Path, r: dict[str, dict]) -> dict:
    """The ~1B and ~8B dense layouts, resharded resume and 1 -> 2 GPU scaling; returns the summary."""
    hf1, hf8 = make_hf("1b", None, work / "hf-1b"), make_hf("8b", args.big_layers, work / "hf-8b")
    save = [f"train.save_interval={args.save_at}"]
    with ThreadPoolExecutor(2) as pool:  # independent one-GPU runs side by side
        a = pool.submit(train, "1b-1gpu", hf1, runs, args, 1, "0")
        b = pool.submit(train, "1b-1gpu-half-batch", hf1, runs, args, 1, "1",
                        f"train.global_batch_size={args.gbs // 2}")
        r["1b-1gpu"], r["1b-1gpu-half-batch"] = a.result(), b.result()
    r["1b-tp2"] = train("1b-tp2", hf1, runs, args, 2, "0,1", "parallel.tp=2", *save)
    r["1b-pp2-vpp2"] = train("1b-pp2-vpp2", hf1, runs, args, 2, "0,1", "parallel.pp=2", "parallel.vpp=2")
    r["1b-dp2"] = train("1b-dp2", hf1, runs, args, 2, "0,1")
    ckpt = runs / "1b-tp2" / "checkpoints" / f"step_{args.save_at:08d}"
    resume = [f"train.resume={ckpt}", f"train.steps={args.save_at + 1}"]
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(train, "1b-resume-tp2-on-1gpu", hf1, runs, args, 1, "0", *resume)
        b = pool.submit(train, "8b-1gpu", hf8, runs, args, 1, "1")
        r["1b-resume-tp2-on-1gpu"], r["8b-1gpu"] = a.result(), b.result()
    r["1b-resume-tp2-at-pp2"] = train("1b-resume-tp2-at-pp2", hf1, runs, args, 2, "0,1", "parallel.pp=2",
                                      *resume)
    r["8b-tp2"] = train("8b-tp2", hf8, runs, args, 2, "0,1", "parallel.tp=2")

    next_step = args.save_at + 1
    tp2_next = r["1b-tp2"].get("loss", {}).get(next_step)
    summary = {
        "loss_gap_vs_1gpu": {k: loss_gap(r[k], r["1b-1gpu"]) for k in ("1b-tp2", "1b-pp2-vpp2", "1b-dp2")},
        "loss_gap_8b_tp2_vs_1gpu": loss_gap(r["8b-tp2"], r["8b-1gpu"]),
        "resharded_resume": {k: {"loss": r[k].get("loss", {}).get(next_step), "tp2_own_next": tp2_next}
                             for k in ("1b-resume-tp2-on-1gpu", "1b-resume-tp2-at-pp2")},
    }
    half, dp2 = r["1b-1gpu-half-batch"], r["1b-dp2"]
    if not half.get("failed") and not dp2.get("failed"):
        summary["scaling_1_to_2_fixed_per_gpu_batch"] = round(dp2["tokens_per_s"] / (2 * half["tokens_per_s"]), 4)

    for name, run in r.items():  # the one-GPU run each layout's loss is compared with
        if name.startswith(("1b", "8b")) and "resume" not in name and "half" not in name:
            run["ref"] = f"{name[:2]}-1gpu"
    return summary


if __name__ == "__main__":
    main()
