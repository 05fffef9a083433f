"""AdamW's parameter groups and the learning-rate schedule, with megatron-core's formulas, so ``train.lr``,
``train.warmup_steps``, ``train.lr_decay_style`` and ``train.weight_decay`` mean the same on both engines."""

from __future__ import annotations

import math

from torch import nn

from loong.core.config.schema import TrainConfig


def lr_at(num_steps: int, t: TrainConfig) -> float:
    """The learning rate after ``num_steps`` optimiser steps (megatron-core's ``OptimizerParamScheduler.get_lr``:
    linear warm-up from 0 over ``min(warmup_steps, steps - 1)`` steps, then cosine / linear / constant decay to
    ``min_lr`` at ``steps``)."""
    warmup = min(t.warmup_steps, max(t.steps - 1, 0))
    decay_steps = max(t.steps, 1)
    if warmup > 0 and num_steps <= warmup:
        return t.lr * num_steps / warmup
    if t.lr_decay_style == "constant":
        return t.lr
    if num_steps > decay_steps:
        return t.min_lr
    ratio = (num_steps - warmup) / max(decay_steps - warmup, 1)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if t.lr_decay_style == "cosine" else 1.0 - ratio
    return t.min_lr + coeff * (t.lr - t.min_lr)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters in two groups: weight decay for matrices, none for biases and norm scales (1-D), as
    megatron-core does. Frozen parameters are left out: they get no optimiser state."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
