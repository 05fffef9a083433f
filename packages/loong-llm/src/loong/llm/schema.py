"""The run schema of ``loong-llm``: the core run config with typed model and data sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from loong.core.config.schema import DataConfig, RunConfig
from loong.llm.models.config import DenseModelConfig


@dataclass
class LLMDataConfig(DataConfig):
    """Text data for pretraining and SFT.

    Pretraining reads ``path`` (a .txt/.jsonl file tokenised on the fly, or the prefix of a
    preprocessed ``.bin``/``.idx`` pair) or ``paths`` (a weighted blend of preprocessed prefixes,
    ``[0.7, a, 0.3, b]``). SFT reads chat data from ``path``.
    """

    paths: list | None = None
    split: str = "969,30,1"
    on_error: Literal["raise", "skip"] = "raise"
    chat_format: Literal["auto", "messages", "sharegpt", "alpaca"] = "auto"
    chat_template: str = "auto"
    packing: bool = True
    overlong: Literal["truncate", "drop"] = "truncate"


@dataclass
class LLMRunConfig(RunConfig):
    """``loong-llm train`` config: ``model`` is a :class:`DenseModelConfig`."""

    model: DenseModelConfig = field(default_factory=DenseModelConfig)
    data: LLMDataConfig = field(default_factory=LLMDataConfig)
