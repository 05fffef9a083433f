"""A training step that ran out of device memory: say so plainly, and list what would make it fit.

torch's ``OutOfMemoryError`` names the allocation that failed, not what to change. Megatron-LM and torchtitan leave
the user there; the knobs that trade memory for time are spread over a dozen options. The list here holds only the
ones this run has not used yet, cheapest first (the task adds its model's own, e.g. activation recomputation), and
says which checkpoint is still intact.
"""

from __future__ import annotations

from pathlib import Path

from loong.core.accelerators.base import Accelerator
from loong.core.accelerators.capabilities import OPTIMIZER_OFFLOAD
from loong.core.config.schema import RunConfig
from loong.core.errors import LoongError


def memory_options(cfg: RunConfig, accelerator: Accelerator, dp: int, bf16: bool, task_hints: list[str]) -> list[str]:
    """What would lower a step's device memory that ``cfg`` does not already do, cheapest first."""
    t = cfg.train
    hints = list(task_hints)
    if t.micro_batch_size > 1:
        hints.append(f"train.micro_batch_size={t.micro_batch_size // 2} (the global batch stays; more accumulation)")
    if bf16 and not t.grad_reduce_in_bf16:
        hints.append("train.grad_reduce_in_bf16=true (bf16 gradient buffer: 2 bytes per parameter saved)")
    offload = OPTIMIZER_OFFLOAD in accelerator.capabilities()
    if not t.distributed_optimizer and dp > 1:
        hints.append("train.distributed_optimizer=true (Adam's state sharded over data parallelism)")
    if offload and not t.optimizer_cpu_offload:
        hints.append("train.distributed_optimizer=true train.optimizer_cpu_offload=true (fp32 master weights and "
                     "Adam's moments in host memory: 12 bytes per parameter off the device)")
    hints.append("more devices for the model: parallel.tp, parallel.pp, parallel.ep (MoE), parallel.cp (long "
                 "sequences)")
    return hints


def out_of_memory_error(step: int, error: BaseException, hints: list[str], device: str,
                        last_checkpoint: Path | None) -> LoongError:
    """The error to raise in place of ``error`` (an out-of-memory in step ``step``, 1-based)."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    kept = (f"the last checkpoint, {last_checkpoint}, is intact" if last_checkpoint is not None
            else "no checkpoint had been written yet")
    options = "\n".join(f"  - {h}" for h in hints)
    return LoongError(f"step {step} ran out of {device} memory ({first_line}); {kept}. "
                      f"Options that lower memory, cheapest first:\n{options}")
