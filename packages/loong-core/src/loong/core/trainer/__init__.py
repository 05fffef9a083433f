"""The one training loop every task runs through."""

from loong.core.trainer.trainer import Trainer, TrainResult

__all__ = ["TrainResult", "Trainer"]
