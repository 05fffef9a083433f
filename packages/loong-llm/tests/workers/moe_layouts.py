"""Qwen3-MoE layout checks, run as ``torchrun --nproc-per-node 2 moe_layouts.py HF_DIR OUT_JSON DENSE_HF_DIR``.

One 2-process gloo launch: the same HF-initialised tiny Qwen3-MoE gives, at TP=1 (DP=2; the single-rank
reference, data-parallel), EP=2, TP=2 (experts TP-split, ETP=2), TP=2 with ETP=1, and TP=2 with EP=2 (ETP=1),
and EP=2 and TP=2 with the experts as grouped products (``model.moe_grouped_mm``),
the loss and every gradient of one step (the load-balancing aux loss's gradient included), then a few
training steps each (with the logged ``moe_aux_loss``); EP=2 runs twice to show the routing is
deterministic, and saves a checkpoint that EP=2 resumes (``pytest`` converts it to HF); every run
exports its weights with ``train.save_hf``. Last, a dense Qwen3 (DENSE_HF_DIR) at TP=2 with sequence
parallelism (``SPRMSNorm``, no Transformer Engine) against TP=1. Rank 0 writes JSON; the pytest side compares.
Helpers come from ``layouts.py``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from layouts import build, one_step_grads  # noqa: E402

from loong.core.accelerators import select_accelerator  # noqa: E402
from loong.core.config.schema import to_dict  # noqa: E402
from loong.core.engines.megatron.engine import MegatronEngine  # noqa: E402
from loong.core.trainer import Trainer  # noqa: E402

STEPS = 4
LAYOUTS = {
    "ref": ["parallel.tp=1"],
    "ep2": ["parallel.ep=2"],
    "tp2": ["parallel.tp=2"],
    "tp2etp1": ["parallel.tp=2", "parallel.etp=1"],
    "tp2ep2": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"],
    # the experts as grouped products (model.moe_grouped_mm): EP=2, and TP=2 whose experts are TP-split (ETP=2)
    "ep2_grouped": ["parallel.ep=2", "model.moe_grouped_mm=true"],
    "tp2_grouped": ["parallel.tp=2", "model.moe_grouped_mm=true"],
}


def _clear_moe_tracker() -> None:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    get_moe_metrics_tracker().clear()  # one_step_grads bypasses the task's per-step report


def train(hf_dir: str, name: str, run_dir: Path, acc, resume: Path | None = None, save_at: int = 0):  # noqa: ANN001, ANN201
    extra = [f"train.save_interval={save_at}", "train.save_hf=true"]
    cfg, layout, task = build(hf_dir, LAYOUTS[name], extra, acc, steps=STEPS)
    engine = MegatronEngine(task, cfg, acc, layout, fresh=resume is None)
    # the whole config, as `loong-llm train` saves it (convert reads the model from it)
    trainer = Trainer(cfg, to_dict(cfg), task, engine, layout, acc, run_dir)
    trainer.fit(trainer.restore(resume) if resume is not None else 0)
    losses, aux = [float("-inf")] * STEPS, [float("-inf")] * STEPS
    if layout.is_logging_rank:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "train_loss" in rec:
                losses[rec["step"] - 1] = rec["train_loss"]
                aux[rec["step"] - 1] = rec.get("moe_aux_loss", float("-inf"))
    t = torch.tensor([losses, aux])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].tolist(), t[1].tolist()


def run(hf_dir: str, out: Path, dense_dir: str) -> None:
    """Every check above; rank 0 writes the JSON to ``out``."""
    acc = select_accelerator("cpu")
    result: dict = {"loss": {}, "grad_err": {}, "grad_keys_equal": {}, "train": {}, "aux": {}, "errors": {}}
    with acc.activate():
        _clear_moe_tracker()
        ref = one_step_grads(hf_dir, LAYOUTS["ref"], acc)
        result["loss"]["ref"] = ref["loss"]
        for name in [n for n in LAYOUTS if n != "ref"] + ["ep2_again"]:
            _clear_moe_tracker()
            try:
                got = one_step_grads(hf_dir, LAYOUTS[name.removesuffix("_again")], acc)
            except Exception as exc:  # a layout megatron refuses: reported, the test says which
                result["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
                continue
            if name == "ep2_again":
                first = result.setdefault("_ep2", {})
                result["deterministic"] = got["loss"] == first["loss"] and all(
                    torch.equal(got["grads"][k], g) for k, g in first["grads"].items())
                continue
            if name == "ep2":
                result["_ep2"] = got
            result["loss"][name] = got["loss"]
            result["grad_keys_equal"][name] = sorted(got["grads"]) == sorted(ref["grads"])
            result["grad_err"][name] = max(
                float((got["grads"][k] - g).abs().max() / g.abs().max().clamp(min=1e-12))
                for k, g in ref["grads"].items()
            )
        result.pop("_ep2", None)
        _clear_moe_tracker()
        root = Path(tempfile.mkdtemp(prefix="loong-moe-layouts-")) if dist.get_rank() == 0 else None
        holder = [str(root)]
        dist.broadcast_object_list(holder, src=0)
        root = Path(holder[0])
        for name in ("ref", "tp2ep2"):
            if name in result["errors"]:
                continue
            result["train"][name], result["aux"][name] = train(hf_dir, name, root / name, acc)
        result["train"]["ep2"], result["aux"]["ep2"] = train(hf_dir, "ep2", root / "ep2", acc, save_at=2)
        ckpt = root / "ep2" / "checkpoints" / "step_00000002"
        result["train"]["ep2_resumed"], _ = train(hf_dir, "ep2", root / "resumed", acc, resume=ckpt)
        result["ep2_checkpoint"] = str(ckpt)
        result["hf_exports"] = {name: str(root / name / "hf") for name in ("ref", "tp2ep2", "ep2")}
        dense_ref = one_step_grads(dense_dir, ["parallel.tp=1"], acc)
        dense_sp = one_step_grads(dense_dir, ["parallel.tp=2", "parallel.sequence_parallel=true"], acc)
        result["dense_sp"] = {
            "loss": [dense_ref["loss"], dense_sp["loss"]],
            "grad_keys_equal": sorted(dense_sp["grads"]) == sorted(dense_ref["grads"]),
            "grad_err": max(float((dense_sp["grads"][k] - g).abs().max() / g.abs().max().clamp(min=1e-12))
                            for k, g in dense_ref["grads"].items()),
        }
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    run(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
