"""SFT with data-parallel balancing against without, run as
``torchrun --nproc-per-node 2 sft_balance.py HF_DIR CHAT_JSONL OUT_DIR``.

In one 2-process gloo launch (DP=2), for packed and unpacked data: the conversations each rank
trains on in step 0, and the loss and full gradients of that step, with and without
``data.balance``; then a balanced run with ``cost=fit`` trained 6 steps straight and the same run
stopped at step 3 and resumed. Rank 0 saves everything with ``torch.save``; pytest compares.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from loong.core.accelerators import select_accelerator
from loong.core.engines.megatron.engine import MegatronEngine
from loong.core.engines.megatron.state import gather_full_state
from loong.llm.sft.task import SFTTask

sys.path.insert(0, str(Path(__file__).parent))
from layouts import build as layouts_build  # noqa: E402
from layouts import fit_and_losses  # noqa: E402  (a sibling worker script)

STEPS = 6


def build(hf_dir: str, chat: str, extra: list[str], acc):  # noqa: ANN001, ANN201
    extra = ["task=sft", f"data.path={chat}", "data.valid_fraction=0", "train.seq_length=96",
             "train.distributed_optimizer=false", "train.warmup_steps=0", *extra]
    return layouts_build(hf_dir, ["parallel.tp=1"], extra, acc, steps=STEPS, task_cls=SFTTask)


def conversations_of_rank(task: SFTTask, step: int, nmb: int) -> list[int]:
    """Document ids this rank trains on in ``step``."""
    if task.balanced is not None:
        return sorted(d for mb in task.balanced.rows(step, task.layout.dp_rank) for row in mb for d in row)
    gbs, mbs = task.cfg.train.global_batch_size, task.cfg.train.micro_batch_size
    rows = [task.sampler.index(g) for g in range(step * gbs, (step + 1) * gbs)]
    mine = rows[task._rank_offset(nmb) : task._rank_offset(nmb) + nmb * mbs]
    return sorted(d for r in mine for d in task.train_data.bins[r])


def one_step(hf_dir: str, chat: str, extra: list[str], acc) -> dict:  # noqa: ANN001
    cfg, layout, task = build(hf_dir, chat, extra, acc)
    engine = MegatronEngine(task, cfg, acc, layout)
    for m in engine.model_chunks:
        m.zero_grad_buffer()
    nmb = task.num_train_microbatches(0, engine.num_microbatches)
    loss = engine._run(engine._iterators(lambda: task.train_microbatches(0, nmb)), forward_only=False,
                       num_microbatches=nmb)
    grads = gather_full_state(engine.model_chunks, source=lambda p: p.main_grad)
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, conversations_of_rank(task, 0, nmb))
    out = {"loss": loss, "grads": grads, "docs": per_rank, "nmb": nmb}
    if task.balanced is not None:
        out["metrics"] = task.balanced.step_metrics(0)
    return out


def main() -> None:
    hf_dir, chat, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    acc = select_accelerator("cpu")
    result: dict = {}
    batch = ["train.global_batch_size=8", "train.micro_batch_size=2"]
    with acc.activate():
        for packing in ("true", "false"):
            for balance in ("false", "true"):
                result[f"packing={packing},balance={balance}"] = one_step(
                    hf_dir, chat, [*batch, f"data.packing={packing}", f"data.balance.enabled={balance}"], acc)
        root = Path(tempfile.mkdtemp(prefix="loong-balance-")) if dist.get_rank() == 0 else None
        holder = [str(root)]
        dist.broadcast_object_list(holder, src=0)
        root = Path(holder[0])
        fit = [*batch, "data.balance.enabled=true", "data.balance.cost=fit", "data.balance.fit_steps=2"]
        cfg, layout, task = build(hf_dir, chat, [*fit, "train.save_interval=3"], acc)
        result["straight"], engine = fit_and_losses(cfg, layout, task, acc, root / "straight", None, STEPS)
        result["straight_params"] = gather_full_state(engine.model_chunks)
        result["fitted"] = task.balanced.balancer.state_dict()["model"]
        cfg, layout, task = build(hf_dir, chat, fit, acc)
        ckpt = root / "straight" / "checkpoints" / "step_00000003"
        result["resumed"], engine = fit_and_losses(cfg, layout, task, acc, root / "resumed", ckpt, STEPS)
        result["resumed_params"] = gather_full_state(engine.model_chunks)
        result["metrics"] = (root / "straight" / "metrics.jsonl").read_text() if dist.get_rank() == 0 else ""
    if dist.get_rank() == 0:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main()
