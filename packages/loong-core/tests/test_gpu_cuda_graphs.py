"""``train.cuda_graphs`` on a GPU (``pytest -m gpu``; CI deselects these, and without CUDA they skip).

- ``StepGraphs`` with the CUDA backend (real ``torch.cuda.CUDAGraph`` capture, bf16 autocast without its cast
  cache, dropout on the device's generator): micro-batches of two shapes alternating within a step give the eager
  step's losses and accumulated gradients, over two steps (the first captures both shapes, the second only
  replays): the captured kernels are the eager ones and a replay draws what the eager step draws.
- The whole walk: the toy LLaMA and DiT trained 10 steps with ``train.cuda_graphs=true`` (``parallel.fsdp=none``)
  log the losses of the same run without graphs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WORKERS = Path(__file__).parent / "workers"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.3), nn.Linear(256, 32)).cuda()


def _batches() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(n, 64, generator=g).cuda(), "y": torch.randn(n, 32, generator=g).cuda()}
            for n in (48, 80, 48, 80)]


def _loss(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        return ((model(batch["x"]).float() - batch["y"]) ** 2).mean()


def test_captured_micro_batches_equal_the_eager_step() -> None:
    from loong.core.accelerators.cuda import CUDAGraphBackend
    from loong.core.engines.fsdp.cuda_graph import StepGraphs

    eager, eager_losses, eager_grads = _model(), [], []
    for step in range(2):
        eager.zero_grad(set_to_none=True)
        for m, batch in enumerate(_batches()):
            torch.manual_seed(10 * step + m)
            loss = _loss(eager, batch)
            (loss * 0.25).backward()
            eager_losses.append(loss.detach())
        eager_grads.append({n: p.grad.clone() for n, p in eager.named_parameters()})

    model, losses, grads = _model(), [], []

    def step_fn(batch: dict, scale: torch.Tensor) -> torch.Tensor:
        loss = _loss(model, batch)
        (loss * scale).backward()
        return loss.detach()

    graphs = StepGraphs(step_fn, list(model.parameters()), CUDAGraphBackend(torch.device("cuda", 0)))
    for step in range(2):
        graphs.zero_grads()
        for m, batch in enumerate(_batches()):
            torch.manual_seed(10 * step + m)
            losses.append(graphs.run(batch, 0.25, first=m == 0))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert graphs.num_graphs == 2 and graphs.num_eager == 0
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-6, atol=0)
    for step in range(2):
        for name, grad in eager_grads[step].items():
            torch.testing.assert_close(grads[step][name], grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, s=step, n=name: f"step {s + 1} {n}: {m}")


def _train(out: Path, name: str, task: str, **train: Any) -> list[float]:
    sys.path.insert(0, str(WORKERS))
    from toy_tasks import toy_config

    from loong.core.run import run

    cfg = toy_config(task=task, output_dir=str(out), run_name=name, parallel={"fsdp": "none"},
                     train={"precision": "bf16", "resume": "none", "save_final": False, **train})
    result = run(cfg, echo=lambda _m: None)
    records = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in records if "train_loss" in r]


@pytest.mark.parametrize("task", ["toy.llama", "toy.dit"])
def test_graphed_runs_log_the_eager_losses(tmp_path: Path, task: str) -> None:
    eager = _train(tmp_path, "eager", task)
    graphed = _train(tmp_path, "graphs", task, cuda_graphs=True)
    assert len(graphed) == len(eager) == 10
    assert graphed[-1] < graphed[0]  # it learns
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=2e-5, atol=0)
