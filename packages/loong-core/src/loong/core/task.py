"""The task seam: what a modality contributes to a run (model, data, loss), and nothing else."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from loong.core.accelerators.base import Accelerator
from loong.core.config.schema import RunConfig
from loong.core.parallel import ParallelLayout


class Task(ABC):
    """A modality's training task. The engine builds and steps the model; the trainer runs the loop.

    Subclasses register with ``@TASKS.register("llm.pretrain")`` and name their engine.
    """

    engine: str = "megatron"

    def __init__(self, cfg: RunConfig, accelerator: Accelerator, layout: ParallelLayout) -> None:
        self.cfg = cfg
        self.accelerator = accelerator
        self.layout = layout

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        """Cheap checks of the composed config, before distributed init, data or model (raise LoongError)."""

    # --- model -----------------------------------------------------------------------------
    @abstractmethod
    def model_config(self, dtype: torch.dtype) -> Any:
        """The engine-level model config (megatron-core ``TransformerConfig`` for ``megatron``)."""

    @abstractmethod
    def build_model(self, config: Any, pre_process: bool, post_process: bool,
                    vp_stage: int | None) -> torch.nn.Module:
        """One pipeline chunk of the model."""

    def init_weights(self, model_chunks: list[torch.nn.Module]) -> None:
        """Called once after a fresh build (not on resume): e.g. load Hugging Face weights."""

    # --- data and loss ---------------------------------------------------------------------
    @abstractmethod
    def setup_data(self) -> None:
        """Read / tokenise / index the data (called once, before training)."""

    @abstractmethod
    def train_microbatches(self, step: int, num_microbatches: int) -> Iterator[dict]:
        """This DP rank's micro-batches for global step ``step`` (deterministic in ``step``)."""

    def num_train_microbatches(self, step: int, default: int) -> int:
        """Micro-batches per DP rank for step ``step`` (the same on every rank).

        ``default`` is ``global_batch_size / (micro_batch_size * dp)``; a task that plans its own
        micro-batches (data-parallel balancing) may need more on some steps.
        """
        return default

    def measures_compute_time(self) -> bool:
        """Whether the engine should measure each step's compute time (``StepMetrics.extra``)."""
        return False

    def after_train_step(self, step: int, extra: dict[str, float]) -> dict[str, float]:
        """Called on every rank after step ``step`` with the engine's extra figures (may be
        collective); returns metrics to log for that step."""
        return {}

    @abstractmethod
    def eval_microbatches(self, index: int, num_microbatches: int) -> Iterator[dict]:
        """This DP rank's micro-batches for evaluation batch ``index``."""

    @abstractmethod
    def forward_step(self, data_iterator: Iterator[dict], model: torch.nn.Module) -> tuple[Any, Any]:
        """megatron-core forward step: returns (output, loss_func)."""

    # --- accounting and artefacts ----------------------------------------------------------
    @abstractmethod
    def tokens_per_step(self) -> int:
        """Tokens in one global batch (for throughput)."""

    def flops_per_token(self) -> float | None:
        """Training FLOPs per token (forward + backward) for MFU; None when unknown."""
        return None

    def memory_hints(self) -> list[str]:
        """Overrides of this task's model that would lower a step's device memory and that this run does not use
        yet (e.g. activation recomputation), cheapest first: shown when a step runs out of memory."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Task state a resumed run needs (JSON-serialisable; saved in every checkpoint)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` from a checkpoint (``{}`` for checkpoints without one)."""

    def save_artifacts(self, checkpoint_dir: Path) -> None:
        """Write task files beside a checkpoint (e.g. the tokenizer). Called on the logging rank."""

    def export(self, model_chunks: list[torch.nn.Module], out_dir: Path) -> Path | None:
        """Export the trained model to the field's format (``train.save_hf``); collective."""
        return None
