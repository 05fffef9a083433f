"""The engine interface the trainer drives, and what every engine shares (dtype, micro-batch count).

An engine owns the model, the optimiser and the LR schedule of a run, and the process groups its parallelism
needs. The walk (``loong.core.run``) asks the engine class for its layout (:meth:`Engine.init_layout`), builds
the task with it, then the engine; the trainer only calls the methods below, so it runs every engine alike.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loong.core.accelerators.base import Accelerator
from loong.core.errors import LoongError
from loong.core.parallel import ParallelLayout


@dataclass
class StepMetrics:
    """What one optimiser step reports (loss is meaningful on the logging rank)."""

    loss: float
    grad_norm: float | None = None
    lr: float = 0.0
    skipped: bool = False
    nonfinite: bool = False  # the loss or a gradient was NaN/Inf; the update was not applied
    extra: dict[str, float] = field(default_factory=dict)
    nonfinite_params: list[str] = field(default_factory=list)  # parameters with NaN/Inf gradients (all ranks)
    nonfinite_origin: str | None = None  # where the backward first produced NaN/Inf (train.nonfinite_probe)


class PendingSave(ABC):
    """A checkpoint write running in the background (``train.async_save``)."""

    @abstractmethod
    def finish(self, blocking: bool) -> bool:
        """Collective: once every rank's shards are written, run the finaliser given at
        :meth:`Engine.save_async` and return True; False while some rank is still writing (``blocking=False``)."""


def resolve_dtype(precision: str, accelerator: Accelerator) -> torch.dtype:
    """``train.precision`` → torch dtype (``auto``: bf16 on GPUs, fp32 on CPU)."""
    if precision == "auto":
        return accelerator.default_dtype()
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


def num_microbatches(cfg: Any, dp: int) -> int:
    """Micro-batches per step per DP rank; the batch sizes must divide evenly."""
    t = cfg.train
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise LoongError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x data-parallel size {dp}"
        )
    return t.global_batch_size // (t.micro_batch_size * dp)


class Engine(ABC):
    """Owns the model, optimiser and LR schedule of a run.

    Class-level hooks set up what the engine needs before any task exists: :meth:`activate` (the
    accelerator's adaptations for this engine's libraries), :meth:`init_layout` (process groups),
    :meth:`seed` and :meth:`shutdown`.
    """

    engine_name: str = "base"  # the registry name (``megatron``, ``fsdp``)
    model_chunks: list[torch.nn.Module]
    layout: ParallelLayout
    dtype: torch.dtype = torch.float32

    # --- set-up before the task (class level) --------------------------------------------------
    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Cheap checks of the keys this engine reads, before distributed init (raise LoongError)."""

    @classmethod
    def activate(cls, accelerator: Accelerator) -> contextlib.AbstractContextManager[None]:
        """The accelerator's state for this engine (e.g. megatron-core's CPU adaptations)."""
        return accelerator.activate(engine=cls.engine_name)

    @classmethod
    @abstractmethod
    def init_layout(cls, accelerator: Accelerator, cfg: Any) -> ParallelLayout:
        """Join (or create) the default process group and build this engine's groups from ``cfg.parallel``."""

    @classmethod
    def seed(cls, seed: int, accelerator: Accelerator, layout: ParallelLayout) -> None:
        """Seed every generator the model build and the step use."""
        accelerator.manual_seed(seed)

    @classmethod
    def shutdown(cls, layout: ParallelLayout | None, clean: bool = False) -> None:
        """Tear down the groups :meth:`init_layout` built, and the default group if the walk created it
        (``clean``: the run ended without an error, so every rank can meet in a barrier first)."""
        from loong.core.parallel import destroy_process_group

        if layout is None or layout.owns_group:
            destroy_process_group(barrier=clean)

    # --- stepping ----------------------------------------------------------------------------
    @abstractmethod
    def train_step(self, step: int) -> StepMetrics:
        """One optimiser step on global batch ``step``."""

    @abstractmethod
    def eval_loss(self, iters: int) -> float | None:
        """Mean loss over ``iters`` evaluation batches (None when there is no eval data)."""

    # --- state -------------------------------------------------------------------------------
    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write model + optimiser state (collective, sharded, layout-independent)."""

    def save_async(self, directory: Path, finalize: Any) -> PendingSave:
        """Start writing what :meth:`save` writes in the background; ``finalize()`` runs on every rank once all
        shards are written (from :meth:`PendingSave.finish`)."""
        raise LoongError(f"train.async_save=true: the {self.engine_name} engine cannot save asynchronously")

    def layout_record(self) -> dict[str, Any]:
        """The layout facts saved in ``trainer_state.json`` (read back by :meth:`check_resume_layout`)."""
        return self.layout.record()

    def check_resume_layout(self, saved: dict) -> None:
        """Raise LoongError when state saved at layout ``saved`` cannot be loaded at this one."""

    @abstractmethod
    def load(self, directory: Path, load_optimizer: bool = True, allow_missing: bool = False) -> None:
        """Restore what :meth:`save` wrote, at any layout (``allow_missing``: keep the fresh
        initialisation of tensors the checkpoint does not hold, for weights-only checkpoints)."""

    @abstractmethod
    def scheduler_state(self) -> dict:
        """LR schedule counters (saved in ``trainer_state.json``)."""

    @abstractmethod
    def load_scheduler_state(self, state: dict) -> None:
        """Restore :meth:`scheduler_state`."""

    def rng_state(self) -> dict[str, Any]:
        """Generator states this engine's library keeps beyond torch/NumPy/Python (saved per rank)."""
        return {}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`rng_state` from the saved per-rank state (which holds every stream)."""

    def memory_hints(self, task_hints: list[str]) -> list[str]:
        """What would lower a step's device memory that this run does not already do, cheapest first
        (``task_hints``: the task's own model options), shown when a step runs out of memory."""
        return list(task_hints)

    def loss_scale(self) -> float:
        """The optimiser's current loss scale (1.0 without fp16 dynamic scaling)."""
        return 1.0

    def export_model(self) -> Any:
        """What the task's ``export`` receives: the model chunks (megatron) or the model (fsdp)."""
        return self.model_chunks

