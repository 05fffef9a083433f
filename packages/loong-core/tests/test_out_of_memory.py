"""The out-of-memory message lists only the memory options a run does not use yet, and only those its hardware and
layout allow (the end-to-end case, torch's error inside a real step, is in loong-llm's test_fault_tolerance)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from loong.core.accelerators.cpu import CPUAccelerator
from loong.core.config.schema import RunConfig
from loong.core.trainer.out_of_memory import memory_options, out_of_memory_error


class CanOffload(CPUAccelerator):
    def capabilities(self) -> set[str]:
        return {"optimizer_offload"}


def test_options_offered_are_the_unused_ones() -> None:
    cfg = RunConfig()
    hints = memory_options(cfg, CanOffload(), dp=2, bf16=True, task_hints=["model.recompute=full"])
    assert [h.split(" ")[0] for h in hints] == [
        "model.recompute=full", "train.micro_batch_size=2", "train.grad_reduce_in_bf16=true",
        "train.distributed_optimizer=true", "train.distributed_optimizer=true", "more"]
    assert "train.optimizer_cpu_offload=true" in hints[4]
    done = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, micro_batch_size=1, grad_reduce_in_bf16=True, distributed_optimizer=True,
        optimizer_cpu_offload=True))
    assert [h.split(" ")[0] for h in memory_options(done, CanOffload(), 2, True, [])] == ["more"]
    # one data-parallel rank has nothing to shard over; fp32 has no bf16 buffer; the CPU cannot offload
    assert [h.split(" ")[0] for h in memory_options(cfg, CPUAccelerator(), 1, False, [])] == [
        "train.micro_batch_size=2", "more"]


def test_message_names_step_cause_and_checkpoint() -> None:
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore detail")
    msg = str(out_of_memory_error(7, err, ["a", "b"], "cuda", Path("/runs/x/checkpoints/step_00000006")))
    assert msg == ("step 7 ran out of cuda memory (CUDA out of memory. Tried to allocate 2.00 GiB.); the last "
                   "checkpoint, /runs/x/checkpoints/step_00000006, is intact. Options that lower memory, cheapest "
                   "first:\n  - a\n  - b")
    assert "no checkpoint had been written yet" in str(out_of_memory_error(1, err, [], "cuda", None))
