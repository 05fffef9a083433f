"""The fsdp engine on a GPU (``pytest -m gpu``; CI deselects these, and without CUDA they skip).

The toy LLaMA and DiT of ``workers/toy_tasks.py`` train through the real walk (``loong.core.run.run``, a world of
one on NCCL) in bf16 mixed precision: eagerly, under ``train.compile=true``, with ``model.recompute=full`` and both,
the loss is finite and falls. An asynchronous save (``train.async_save=true``) completes into a verified checkpoint,
and a run resumed from it continues with the uninterrupted run's losses. FP8 linears (``precision.fp8``) on the
native ``_scaled_mm`` path, under FSDP2, DDP and DDP + ``train.cuda_graphs``: every linear layer converts and the
run logs the bf16 run's losses within 2%. Tiny models, 10 steps a run.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WORKERS = Path(__file__).parent / "workers"


def _train(out: Path, name: str, task: str = "toy.llama", model: dict | None = None, sections: dict | None = None,
           said: list[str] | None = None, **train: Any) -> tuple[Any, list]:
    """A bf16 toy run on the GPU (``sections``: more config sections; ``said``: collects the run's log lines);
    returns (its TrainResult, the logged training records)."""
    sys.path.insert(0, str(WORKERS))
    from toy_tasks import toy_config

    from loong.core.run import run

    cfg = toy_config(task=task, model=model or {}, output_dir=str(out), run_name=name, **(sections or {}),
                     train={"precision": "bf16", "resume": "none", "save_final": False, **train})
    result = run(cfg, echo=(said.append if said is not None else lambda _m: None))
    records = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, [r for r in records if "train_loss" in r]


@pytest.mark.parametrize("task,compile_,recompute", [
    ("toy.llama", False, "none"), ("toy.llama", True, "none"), ("toy.llama", False, "full"),
    ("toy.llama", True, "full"), ("toy.dit", False, "selective"), ("toy.dit", True, "full"),
])  # fmt: skip
def test_toy_models_train_in_bf16(tmp_path: Path, capsys: pytest.CaptureFixture, task: str, compile_: bool,
                                  recompute: str) -> None:
    result, records = _train(tmp_path, "run", task, {"recompute": recompute}, compile=compile_)
    losses = [r["train_loss"] for r in records]
    assert result.last_step == 10 and len(losses) == 10
    assert all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < losses[0], losses  # it learns
    assert records[-1]["peak_memory_gib"] > 0  # the CUDA accelerator's memory statistics: it ran on the GPU
    if compile_:  # the engine reports torch.compile's graph breaks (or none) after the first compiled step
        assert "train.compile:" in capsys.readouterr().out


def test_async_save_completes_and_resumes(tmp_path: Path) -> None:
    from loong.core.checkpoint import read_state, verify_checkpoint

    whole, records = _train(tmp_path, "whole", steps=6, save_interval=3, async_save=True)
    step3 = whole.run_dir / "checkpoints" / "step_00000003"
    verify_checkpoint(step3)  # complete: manifest written, every file's checksum right
    assert read_state(step3)["step"] == 3
    resumed, again = _train(tmp_path, "resumed", steps=6, async_save=True, resume=str(step3))
    assert resumed.last_step == 6 and [r["step"] for r in again] == [4, 5, 6]
    for a, b in zip(again, records[3:], strict=True):  # the same batches from the same state (bf16: near, not bitwise)
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-2 * abs(b["train_loss"]), (a, b)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 matrix products need compute capability >= 8.9")
@pytest.mark.parametrize("recipe,fsdp,graphs", [
    ("tensorwise", "full", False), ("rowwise", "full", False), ("tensorwise", "none", False),
    ("tensorwise", "none", True),
])  # fmt: skip
def test_fp8_linears_train_like_bf16(tmp_path: Path, recipe: str, fsdp: str, graphs: bool) -> None:
    said: list[str] = []
    _, bf16 = _train(tmp_path, "bf16", sections={"parallel": {"fsdp": fsdp}}, cuda_graphs=graphs)
    _, fp8 = _train(tmp_path, "fp8", sections={"parallel": {"fsdp": fsdp}, "precision": {"fp8": recipe}},
                    said=said, cuda_graphs=graphs)
    assert "fp8: 15 of 15 linear layers run in fp8" in said, said  # 2 x (q, k, v, o, gate, up, down) + output
    a, b = [r["train_loss"] for r in fp8], [r["train_loss"] for r in bf16]
    assert len(a) == len(b) == 10 and sum(a[-3:]) / 3 < a[0], a  # it learns
    assert a != b  # the GEMMs did change
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= 0.02 * abs(y), (a, b)
