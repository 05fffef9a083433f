"""The task seam: what a modality contributes to a run (model, data, loss), and nothing else.

:class:`Task` is what every engine and the trainer need: config checks, data, accounting, task state and
artefacts. How the model is built and how its loss is computed depends on the engine, so each engine defines
the small interface it needs on top:

- ``megatron`` (:class:`loong.core.engines.megatron.task.MegatronTask`): ``model_config`` → a
  ``TransformerConfig``, ``build_model`` of one pipeline chunk, ``forward_step`` → ``(output, loss_func)``;
- ``fsdp`` (:class:`loong.core.engines.fsdp.task.FSDPTask`): ``build_model()`` → a plain ``nn.Module`` and
  ``loss(model, batch)`` → ``(loss, metrics)``.

A task names its engine (``engine = "fsdp"``); the run refuses a config whose ``engine`` differs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loong.core.accelerators.base import Accelerator
from loong.core.parallel import ParallelLayout


class Task(ABC):
    """A modality's training task. The engine builds and steps the model; the trainer runs the loop.

    Subclasses register with ``@TASKS.register("llm.pretrain")`` and subclass their engine's task class.
    """

    engine: str = ""

    def __init__(self, cfg: Any, accelerator: Accelerator, layout: ParallelLayout) -> None:
        self.cfg = cfg
        self.accelerator = accelerator
        self.layout = layout
        #: the run directory (``<output_dir>/<run_name>``), set by the walk before training starts: where a task
        #: writes files of its own beside the run's metrics and loss plot (e.g. loong-diffusion's previews)
        self.run_dir: Path | None = None

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Cheap checks of the composed config, before distributed init, data or model (raise LoongError)."""

    # --- data --------------------------------------------------------------------------------
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

    def num_eval_microbatches(self, index: int, default: int) -> int:
        """Micro-batches per DP rank for evaluation batch ``index`` (the same on every rank); as
        :meth:`num_train_microbatches`, for a task whose planned micro-batches hold a token budget."""
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

    def export(self, model: Any, out_dir: Path) -> Path | None:
        """Export the trained model to the field's format (``train.save_hf``); collective. ``model`` is what the
        engine trains: megatron's list of model chunks, the fsdp engine's (sharded) module."""
        return None
