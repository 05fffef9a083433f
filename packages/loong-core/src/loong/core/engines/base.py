"""The engine interface the trainer drives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import torch


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


class Engine(ABC):
    """Owns the model chunks, optimiser and LR schedule of a run."""

    model_chunks: list[torch.nn.Module]

    @abstractmethod
    def train_step(self, step: int) -> StepMetrics:
        """One optimiser step on global batch ``step``."""

    @abstractmethod
    def eval_loss(self, iters: int) -> float | None:
        """Mean loss over ``iters`` evaluation batches (None when there is no eval data)."""

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write model + optimiser + scheduler state (collective, sharded, layout-independent)."""

    def check_resume_layout(self, saved: dict) -> None:
        """Raise LoongError when state saved at layout ``saved`` cannot be loaded at this one."""

    @abstractmethod
    def load(self, directory: Path, load_optimizer: bool = True, allow_missing: bool = False) -> None:
        """Restore what :meth:`save` wrote, at any layout (``allow_missing``: keep the fresh
        initialisation of tensors the checkpoint does not hold, for weights-only checkpoints)."""
