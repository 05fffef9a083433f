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

    @classmethod
    def component_layouts(cls, cfg: Any) -> dict[str, int]:
        """Components of the model that run at their own tensor-parallel size: ``{name: tp}`` (each dividing
        ``parallel.tp``). The engine builds each one's process-group collection with the layout
        (:attr:`~loong.core.engines.megatron.layout.MegatronLayout.components`); the task hands it to that
        component. Empty: the whole model at ``parallel.tp``."""
        return {}

    @abstractmethod
    def model_config(self, dtype: torch.dtype) -> Any:
        """The megatron-core ``TransformerConfig`` of the model."""

    @abstractmethod
    def build_model(self, config: Any, pre_process: bool, post_process: bool,
                    vp_stage: int | None) -> torch.nn.Module:
        """One pipeline chunk of the model."""

    def init_weights(self, model_chunks: list[torch.nn.Module]) -> None:
        """Called once after a fresh build (not on resume): e.g. load Hugging Face weights."""

    def optimizer_overrides(self, lr: float, min_lr: float) -> dict[Any, Any]:
        """Per-parameter optimiser settings on top of megatron-core's standard ones (no weight decay on biases
        and norms): ``{megatron.core.optimizer.ParamKey: ParamGroupOverride}``, e.g. ``{"max_lr": 0.1 * lr,
        "min_lr": 0.1 * min_lr}`` for a component trained at a tenth of the learning rate (``lr`` / ``min_lr``:
        ``train.lr`` / ``train.min_lr``). Parameter names are those under the DDP (and Float16Module) wrappers,
        e.g. ``module.encoder.blocks.0.qkv.weight``. Empty: the standard settings only."""
        return {}

    @abstractmethod
    def forward_step(self, data_iterator: Iterator[dict], model: torch.nn.Module) -> tuple[Any, Any]:
        """megatron-core forward step: returns (output, loss_func)."""
