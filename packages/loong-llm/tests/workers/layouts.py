"""Multi-rank layout checks, run as ``torchrun --nproc-per-node 2 layouts.py HF_DIR OUT_JSON``.

In one 2-process gloo launch (process start-up dominates CI time): for TP=1 (DP=2), TP=2, PP=2,
PP=2 with two virtual stages each (interleaved 1F1B) and CP=2 (zigzag chunks, all-gather attention),
the same HF-initialised weights give the loss and full gradients of one step, and 20 training steps;
TP=2 saves a checkpoint at step 10, which TP=1 and PP=2 then resume. Rank 0 writes everything as JSON; the
pytest side compares.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from loong.core.accelerators import select_accelerator
from loong.core.config import compose_config
from loong.core.engines.megatron.engine import MegatronEngine
from loong.core.engines.megatron.layout import init_distributed
from loong.core.engines.megatron.state import gather_full_state
from loong.core.trainer import Trainer
from loong.llm.pretrain import PretrainTask
from loong.llm.schema import LLMRunConfig

STEPS = 20


def build(hf_dir: str, layout_overrides: list[str], extra: list[str], acc, steps: int = STEPS,  # noqa: ANN001, ANN201
          lr: str = "1e-3", task_cls: type = PretrainTask):
    """Config, layout and data-ready task for a small HF-initialised run at a layout."""
    overrides = [f"model.init_from_hf={hf_dir}", f"train.steps={steps}", "train.seq_length=32",
                 "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_iters=0",
                 "train.progress=false", f"train.lr={lr}", *layout_overrides, *extra]
    cfg, _ = compose_config("loong.llm.configs", "pretrain", overrides, LLMRunConfig)
    task_cls.check_config(cfg)
    layout = init_distributed(acc, cfg.parallel)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    task = task_cls(cfg, acc, layout)
    task.setup_data()
    return cfg, layout, task


def one_step_grads(hf_dir: str, layout_overrides: list[str], acc) -> dict:  # noqa: ANN001
    cfg, layout, task = build(hf_dir, layout_overrides, ["train.distributed_optimizer=false"], acc)
    engine = MegatronEngine(task, cfg, acc, layout)
    for m in engine.model_chunks:
        m.zero_grad_buffer()
    loss = engine._run(engine._iterators(lambda: task.train_microbatches(0, engine.num_microbatches)),
                       forward_only=False)
    grads = gather_full_state(engine.model_chunks, source=lambda p: p.main_grad)
    loss_t = torch.tensor([loss if layout.is_logging_rank else float("-inf")])
    dist.all_reduce(loss_t, op=dist.ReduceOp.MAX)
    return {"loss": float(loss_t), "grads": grads}


def fit_and_losses(cfg, layout, task, acc, run_dir: Path, resume: Path | None, steps: int):  # noqa: ANN001, ANN201
    """Train (or resume) to the end; return every step's loss on all ranks and the engine."""
    engine = MegatronEngine(task, cfg, acc, layout, fresh=resume is None)
    trainer = Trainer(cfg, {"model": {}}, task, engine, layout, acc, run_dir)
    start = trainer.restore(resume) if resume is not None else 0
    trainer.fit(start)
    losses = [float("-inf")] * steps
    if layout.is_logging_rank:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "train_loss" in rec:
                losses[rec["step"] - 1] = rec["train_loss"]
    t = torch.tensor(losses)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist(), engine


def train(hf_dir: str, layout_overrides: list[str], run_dir: Path, acc, resume: Path | None = None,  # noqa: ANN001
          save_at: int = 0) -> list[float]:
    cfg, layout, task = build(hf_dir, layout_overrides, [f"train.save_interval={save_at}"], acc)
    return fit_and_losses(cfg, layout, task, acc, run_dir, resume, STEPS)[0]


def main() -> None:
    hf_dir, out = sys.argv[1], Path(sys.argv[2])
    acc = select_accelerator("cpu")
    layouts = {"tp1": ["parallel.tp=1"], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"],
               "pp2vpp2": ["parallel.pp=2", "parallel.vpp=2"], "cp2": ["parallel.cp=2"]}
    result: dict = {"loss": {}, "grad_err": {}, "train": {}}
    with acc.activate():
        ref = one_step_grads(hf_dir, layouts["tp1"], acc)
        result["loss"]["tp1"] = ref["loss"]
        for name in ("tp2", "pp2", "pp2vpp2", "cp2"):
            got = one_step_grads(hf_dir, layouts[name], acc)
            result["loss"][name] = got["loss"]
            result["grad_err"][name] = max(
                float((got["grads"][k] - g).abs().max() / g.abs().max().clamp(min=1e-12))
                for k, g in ref["grads"].items()
            )
            result.setdefault("grad_keys_equal", {})[name] = sorted(got["grads"]) == sorted(ref["grads"])
        root = Path(tempfile.mkdtemp(prefix="loong-layouts-")) if dist.get_rank() == 0 else None
        holder = [str(root)]
        dist.broadcast_object_list(holder, src=0)
        root = Path(holder[0])
        for name in ("tp1", "pp2", "pp2vpp2", "cp2"):
            result["train"][name] = train(hf_dir, layouts[name], root / name, acc)
        result["train"]["tp2"] = train(hf_dir, layouts["tp2"], root / "tp2", acc, save_at=10)
        ckpt = root / "tp2" / "checkpoints" / "step_00000010"
        result["train"]["tp1_resumed_from_tp2"] = train(hf_dir, layouts["tp1"], root / "resumed", acc,
                                                        resume=ckpt)
        result["train"]["pp2_resumed_from_tp2"] = train(hf_dir, layouts["pp2"], root / "resumed_pp", acc,
                                                        resume=ckpt)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
