"""Packed, DP-balanced training steps on 2 gloo processes: ``torchrun --nproc-per-node 2 wan_pack.py OUT_JSON``.

Each case builds the fsdp engine for the ``diffusion.wan`` task with ``data.pack_tokens`` and mixed
``data.sizes`` in one layout over the two ranks — data parallelism (each rank its planned share of the global batch)
or context parallelism (Ulysses or ring over one pack each micro-batch) — and runs two training steps and one
evaluation. The reference, computed on every rank by hand, is one process over the same global batch unpacked: each
clip alone through a plain ``WanTransformer`` with the engine's weights before the step, the step's loss the mean of the
clips' MSEs, its gradient the gradient of that mean. Rank 0 writes the largest relative errors as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from loong.core.accelerators import select_accelerator
from loong.core.config import from_dict
from loong.core.engines.fsdp.engine import FSDPEngine
from loong.core.engines.fsdp.wrap import clean_name
from loong.diffusion.models.wan import WanTransformer
from loong.diffusion.schema import DiffusionRunConfig
from loong.diffusion.task import EVAL_OFFSET, WanTask

#: latent sizes of 64, 16, 6 and 18 video tokens (patch 1 × 2 × 2): odd totals, so that CP packs need padding
SIZES = [[4, 8, 8], [2, 8, 4], [1, 4, 6], [3, 4, 6]]
GLOBAL_BATCH = 8
#: data.seed 4 draws sizes of 6 to 64 tokens for step 0's clips, and at step 1 a plan in which rank 1 has an empty
#: micro-batch (it packs a clip of weight 0, to run the step's collectives)
STEPS = 2
CASES = {"dp2": {}, "ulysses2": {"cp_ulysses": 2}, "ring2": {"cp_ring": 2}}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


def reference(task: WanTask, weights: dict[str, torch.Tensor], first: int,
              backward: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """The unpacked step over samples ``first ..``: the mean of each clip's own MSE, and its gradients."""
    model = WanTransformer(task.wan)
    model.load_state_dict({k.removeprefix("wan."): v for k, v in weights.items()})
    losses = []
    for i in range(first, first + GLOBAL_BATCH):
        s = task.sample(i)
        timestep = s["timestep"][None] if s["timestep"].ndim else s["timestep"].reshape(1)
        losses.append(F.mse_loss(model(s["noisy"][None], timestep, s["text"][None]), s["target"][None]))
    loss = torch.stack(losses).mean()
    if backward:
        loss.backward()
    return float(loss.detach()), {f"wan.{n}": p.grad for n, p in model.named_parameters() if p.grad is not None}


def run_case(name: str, parallel: dict) -> dict:
    cfg = from_dict(DiffusionRunConfig, {
        "data": {"sizes": SIZES, "pack_tokens": 70, "num_clips": 16, "seed": 4},
        "train": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": GLOBAL_BATCH // 2, "precision": "fp32",
                  "clip_grad": 0.0, "seed": 7},
        "parallel": parallel, "output_dir": "unused", "run_name": name})
    FSDPEngine.check_config(cfg)
    WanTask.check_config(cfg)
    acc = select_accelerator()
    layout = FSDPEngine.init_layout(acc, cfg)
    FSDPEngine.seed(cfg.train.seed, acc, layout)
    task = WanTask(cfg, acc, layout)
    task.setup_data()
    engine = FSDPEngine(task, cfg, acc, layout)
    record: dict = {"steps": []}
    for step in range(STEPS):
        weights = {clean_name(n): _whole(p) for n, p in engine.model.named_parameters()}
        step_plan = task.packer.plan(step * GLOBAL_BATCH)
        metrics = engine.train_step(step)
        grads = {clean_name(n): _whole(p.grad) for n, p in engine.model.named_parameters()}
        want_loss, want_grads = reference(task, weights, step * GLOBAL_BATCH, backward=True)
        record["steps"].append({
            "loss": abs(metrics.loss - want_loss) / want_loss,
            "grads": max(_error(grads[n], want_grads[n]) for n in want_grads),
            "params": len(want_grads),
            "micro_batches": step_plan.num_micro_batches,
            "ranks": [[sorted(mb) for mb in rank] for rank in step_plan.micro_batches],
            "tokens": step_plan.lengths.tolist(),
        })
    evaluated = engine.eval_loss(1)
    with torch.no_grad():
        want_eval, _ = reference(task, {clean_name(n): _whole(p) for n, p in engine.model.named_parameters()},
                                 EVAL_OFFSET, backward=False)
    record["eval"] = abs(evaluated - want_eval) / want_eval
    FSDPEngine.shutdown(layout)  # leaves the group this worker made
    return record


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    report = {name: run_case(name, parallel) for name, parallel in CASES.items()}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
