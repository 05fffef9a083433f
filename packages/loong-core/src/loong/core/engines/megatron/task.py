"""What the megatron engine needs from a task: a megatron-core config, the model chunks, the forward step."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from typing import Any

import torch

from loong.core.task import Task


class MegatronTask(Task):
    """A task trained by the ``megatron`` engine (pipeline chunks, megatron-core schedules)."""

    engine = "megatron"

    @abstractmethod
    def model_config(self, dtype: torch.dtype) -> Any:
        """The megatron-core ``TransformerConfig`` of the model."""

    @abstractmethod
    def build_model(self, config: Any, pre_process: bool, post_process: bool,
                    vp_stage: int | None) -> torch.nn.Module:
        """One pipeline chunk of the model."""

    def init_weights(self, model_chunks: list[torch.nn.Module]) -> None:
        """Called once after a fresh build (not on resume): e.g. load Hugging Face weights."""

    @abstractmethod
    def forward_step(self, data_iterator: Iterator[dict], model: torch.nn.Module) -> tuple[Any, Any]:
        """megatron-core forward step: returns (output, loss_func)."""
