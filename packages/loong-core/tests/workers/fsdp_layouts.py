"""Toy models trained by the fsdp engine in several layouts, in one launch (``torchrun --nproc-per-node 2``) or in
one process (a world of one: the references).

``python fsdp_layouts.py OUT NAME...``: for each named case (see ``CASES``) train ``STEPS`` steps and write, from
rank 0, ``OUT/<NAME>.pt`` with every step's loss and grad norm, the (clipped) gradients of steps 1 and ``STEPS``
and the final weights, all as whole tensors (``-ema`` cases: also the weights before and after every step and the
final moving averages). ``reshard`` cases go through the real walk (``loong.core.run.run``) and write their logged
losses instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))

from graph_replay import ReplayingCPUAccelerator  # noqa: E402
from toy_tasks import toy_config  # noqa: E402

from loong.core.accelerators import select_accelerator  # noqa: E402
from loong.core.engines.fsdp.engine import FSDPEngine  # noqa: E402
from loong.core.engines.fsdp.wrap import clean_name  # noqa: E402
from loong.core.registry import TASKS  # noqa: E402

STEPS = 10
#: ``train.ema_decay`` of the ``-ema`` cases: low, so that 10 steps move the average well away from where it started
EMA_DECAY = 0.6
LAYOUTS = {
    "full": {"fsdp": "full"},
    "hybrid2x1": {"fsdp": "hybrid", "dp_replicate": 2, "dp_shard": 1},
    "hybrid1x2": {"fsdp": "hybrid", "dp_replicate": 1, "dp_shard": 2},
    "ddp": {"fsdp": "none"},
    "ddp1": {"fsdp": "none"},  # the same, named apart for a one-process case beside the world-2 one
    # context parallelism (world 4): Ulysses, ring, both; with FSDP over the remaining ranks, or HSDP, or DDP
    "ulysses2": {"cp_ulysses": 2},
    "ring2": {"cp_ring": 2},
    "ulysses2xring2": {"cp_ulysses": 2, "cp_ring": 2},
    "hybrid2x1ring2": {"fsdp": "hybrid", "dp_replicate": 2, "cp_ring": 2},
    "ddpulysses2": {"fsdp": "none", "cp_ulysses": 2},
}


def case_config(name: str, out: Path):  # noqa: ANN201
    """``<task>-<layout>[-<variant>]``: e.g. ``llama-full-recompute_full``, ``dit-ddp``, ``llama-single-frozen``,
    ``dit-hybrid2x1-offload`` (``parallel.fsdp_cpu_offload``), ``llama-full-ema`` (``train.ema_decay``),
    ``llama-ddp-graphs`` (``train.cuda_graphs`` through :mod:`graph_replay`'s CPU backend)."""
    task, layout, *variant = name.split("-")
    model: dict = {}
    train: dict = {}
    parallel = dict(LAYOUTS.get(layout, {}))
    for v in variant:
        if v == "ema":
            train["ema_decay"] = EMA_DECAY
        elif v == "graphs":
            train["cuda_graphs"] = True
        elif v == "offload":
            parallel["fsdp_cpu_offload"] = True
        elif v.startswith("recompute_"):
            model["recompute"] = v.removeprefix("recompute_")
        elif v == "frozen":
            model["freeze"] = ["embed", "layers.0.attn"] if task == "llama" else ["patch", "text"]
    return toy_config(task=f"toy.{task}", model=model, parallel=parallel, train=train,
                      output_dir=str(out), run_name=name)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train_case(name: str, out: Path) -> dict:
    """Drive the engine directly (no trainer) to read the gradients after each step."""
    cfg = case_config(name, out)
    acc = ReplayingCPUAccelerator() if cfg.train.cuda_graphs else select_accelerator()
    layout = FSDPEngine.init_layout(acc, cfg)
    FSDPEngine.seed(cfg.train.seed, acc, layout)
    task = TASKS.get(cfg.task)(cfg, acc, layout)
    task.setup_data()
    engine = FSDPEngine(task, cfg, acc, layout)
    record: dict = {"loss": [], "grad_norm": [], "grads": {}, "optimizer_params": 0}

    def weights() -> dict[str, torch.Tensor]:
        return {clean_name(n): _whole(p) for n, p in engine.model.named_parameters()}

    trajectory = [weights()] if engine.ema is not None else []
    for step in range(STEPS):
        m = engine.train_step(step)
        record["loss"].append(m.loss)
        record["grad_norm"].append(m.grad_norm)
        if engine.ema is not None:
            trajectory.append(weights())
        if step in (0, STEPS - 1):
            record["grads"][step] = {clean_name(n): _whole(p.grad) for n, p in engine.model.named_parameters()
                                     if p.grad is not None}
    record["weights"] = weights()
    if engine.ema is not None:
        record["trajectory"] = trajectory
        record["ema"] = {name: _whole(t) for name, t in engine.ema.state_dict().items()}
    record["optimizer_params"] = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    if engine.graphs is not None:
        backend = engine.graphs._backend
        record["graphs"] = {"graphs": engine.graphs.num_graphs, "eager": engine.graphs.num_eager,
                            "captures": backend.captures, "replays": backend.replays}
    record["optimizer_state"] = len(engine.optimizer.state)
    FSDPEngine.shutdown(layout)  # leaves a group the worker made itself
    return record


def reshard_case(name: str, out: Path) -> dict:
    """``reshard_save``: full sharding, 6 steps, checkpoints at 5 and 6. ``reshard_<layout>``: resume the step-5
    checkpoint at that layout for step 6."""
    from loong.core.run import run

    layout = name.removeprefix("reshard_")
    saving = layout == "save"
    cfg = toy_config(task="toy.llama", parallel=LAYOUTS.get("full" if saving else layout, {}),
                     train={"steps": 6, "save_interval": 5 if saving else 0,
                            "resume": "none" if saving else str(out / "reshard_save" / "checkpoints" /
                                                                "step_00000005")},
                     output_dir=str(out), run_name=name)
    result = run(cfg, echo=lambda _m: None)
    return {"last_loss": result.last_loss, "last_step": result.last_step}


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    distributed = "TORCHELASTIC_RUN_ID" in os.environ  # started by torchrun (a plain run is the world of one)
    if distributed:
        dist.init_process_group("gloo")  # kept across the cases: the walk does not tear down a group it did not make
    for name in names:
        record = reshard_case(name, out) if name.startswith("reshard_") else train_case(name, out)
        if not distributed or dist.get_rank() == 0:
            torch.save(record, out / f"{name}.pt")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
