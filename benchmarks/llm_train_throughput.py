"""Training throughput of `loong-llm train` against Hugging Face transformers, side by side.

Both train the same LLaMA-shaped model (default: the ``llama3_2_1b`` preset, 1.24B parameters) at the
same sequence length, micro-batch and global batch, in bf16 with fp32 master weights and AdamW.
Each runs in its own process (clean memory statistics). Prints a table and writes JSON with the
command, versions, hardware and figures to ``benchmarks/results/``.

    python benchmarks/llm_train_throughput.py --preset llama3_2_1b --seq 4096 --mbs 4 --gbs 16 --steps 30
    python benchmarks/llm_train_throughput.py --preset tiny --seq 128 --mbs 16 --gbs 16 --steps 60   # CPU

On CPU the figures are tokens/s only (fp32 on both sides, no MFU or device memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _env import host, versions  # benchmarks/_env.py (run as scripts from the repo root)

RESULTS = Path(__file__).parent / "results"


def _loong(args: argparse.Namespace, out: Path, overrides: tuple[str, ...] = (), run_name: str = "loong") -> dict:
    """One ``loong-llm train`` run in its own process; medians over the steps after ``args.warmup``."""
    cmd = [sys.executable, "-m", "loong.llm.cli", "train", f"model={args.preset}",
           f"train.seq_length={args.seq}", f"train.micro_batch_size={args.mbs}",
           f"train.global_batch_size={args.gbs}", f"train.steps={args.steps}", "train.eval_iters=0",
           "train.eval_interval=0", "train.progress=false", "train.save_final=false", "train.lr=3e-4",
           "train.min_lr=3e-5", "train.warmup_steps=5", f"output_dir={out}", f"run_name={run_name}", *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr[-3000:], "command": " ".join(cmd)}
    recs = [json.loads(x) for x in (out / run_name / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "train_loss" in r][args.warmup:]
    return {
        "command": "loong-llm " + " ".join(cmd[3:]),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs),
        "mfu": statistics.median(r["mfu"] for r in recs) if "mfu" in recs[0] else None,
        "peak_memory_gib": max(r["peak_memory_gib"] for r in recs) if "peak_memory_gib" in recs[0] else None,
        "loss_first_last": [recs[0]["train_loss"], recs[-1]["train_loss"]],
        "wall_s": round(time.time() - t0, 1),
    }


def _hf_worker(args: argparse.Namespace) -> None:
    """Baseline: HF LlamaForCausalLM, SDPA, bf16 autocast over fp32 weights, fused AdamW."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from loong.core.config import compose_config
    from loong.llm.models.config import training_flops_per_token
    from loong.llm.schema import LLMRunConfig

    cfg, _ = compose_config("loong.llm.configs", "pretrain", [f"model={args.preset}"], LLMRunConfig)
    m = cfg.model
    rope = None
    if m.rope_scaling is not None:
        rope = {"rope_type": "llama3", "factor": m.rope_scaling.factor, "low_freq_factor": m.rope_scaling.low_freq_factor,
                "high_freq_factor": m.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": m.rope_scaling.original_max_position_embeddings}
    hf_cfg = LlamaConfig(hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size, num_hidden_layers=m.num_layers,
                         num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups,
                         head_dim=m.kv_channels, vocab_size=m.vocab_size, max_position_embeddings=m.max_position_embeddings,
                         rope_theta=m.rope_theta, rope_scaling=rope, tie_word_embeddings=m.tie_word_embeddings,
                         rms_norm_eps=m.norm_eps, attn_implementation="sdpa")
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    model = LlamaForCausalLM(hf_cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=gpu)
    accum = args.gbs // args.mbs
    gen = torch.Generator(device=device).manual_seed(0)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    tps = []
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        for _ in range(accum):
            ids = torch.randint(0, 512, (args.mbs, args.seq + 1), device=device, generator=gen)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=gpu):
                loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        tps.append(args.gbs * args.seq / (time.perf_counter() - t0))
    tok_s = statistics.median(tps[args.warmup:])
    mfu = tok_s * training_flops_per_token(m, args.seq) / 989e12 if gpu else None
    mem = round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None
    print(json.dumps({"tokens_per_s": round(tok_s, 1), "mfu": None if mfu is None else round(mfu, 4),
                      "peak_memory_gib": mem}))


def _hf(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--hf-worker", f"--preset={args.preset}", f"--seq={args.seq}",
           f"--mbs={args.mbs}", f"--gbs={args.gbs}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr[-3000:]}
    return {"command": " ".join(cmd[1:]), **json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3_2_1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--gbs", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the figures")
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="JSON path (default: results/llm_train_<gpu>_<date>.json)")
    args = p.parse_args()
    if args.hf_worker:
        _hf_worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        loong = _loong(args, Path(tmp))
    hf = _hf(args)
    rows = [("loong-llm (megatron-core, SDPA spec)", loong), ("HF transformers (SDPA, autocast)", hf)]
    print(f"\n{args.preset}  seq={args.seq} micro-batch={args.mbs} global-batch={args.gbs} steps={args.steps}")
    print(f"{'stack':<40}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}")
    for name, r in rows:
        if "error" in r:
            print(f"{name:<40}  failed: {r['error'].strip().splitlines()[-1][:80]}")
        else:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
            mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
            print(f"{name:<40}{r['tokens_per_s']:>12,.0f}{mfu:>8}{mem:>10}")
    if "error" not in loong and "error" not in hf:
        print(f"speed-up over HF: {loong['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
    hw = host()
    result = {"benchmark": "llm_train_throughput", "date": time.strftime("%Y-%m-%d"),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "args": vars(args),
              "versions": versions(["torch", "megatron-core", "transformers", "loong-core", "loong-llm", "triton"]), "hardware": hw, "loong": loong, "hf_transformers": hf}
    RESULTS.mkdir(exist_ok=True)
    tag = (hw.get("gpu") or "cpu").split()[-1].lower()  # e.g. h200, or cpu
    out = Path(args.out) if args.out else RESULTS / f"llm_train_{tag}_{args.preset}_{time.strftime('%Y%m%d')}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
