"""Engines turn (task, layout, optimiser config) into train/eval steps and checkpointable state."""

from loong.core.engines.base import Engine, StepMetrics

__all__ = ["Engine", "StepMetrics"]
