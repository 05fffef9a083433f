"""The run schema of ``loong-llm``: the core run config with typed model and data sections."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from loong.core.config.checks import Check, NonEmptyStr
from loong.core.config.schema import DataConfig, RunConfig
from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig


def split_weights(split: str) -> list[float]:
    """``data.split`` (``"969,30,1"``) as its train/valid/test weights; LoongError when it is not one."""
    parts = [p.strip() for p in str(split).split(",")]
    try:
        vector = [float(p) for p in parts]
    except ValueError:
        vector = []
    if not 1 <= len(vector) <= 3 or any(v < 0 or not math.isfinite(v) for v in vector) or not vector[0] > 0:
        raise LoongError(f"data.split: expected up to three non-negative train,valid,test weights "
                         f"with train > 0 (e.g. 969,30,1), got {split!r}")
    return vector


@dataclass
class LLMDataConfig(DataConfig):
    """Text data for pretraining and SFT.

    Pretraining reads ``path`` (a .txt/.jsonl file tokenised on the fly, or the prefix of a
    preprocessed ``.bin``/``.idx`` pair) or ``paths`` (a weighted blend of preprocessed prefixes,
    ``[0.7, a, 0.3, b]``). SFT reads chat data from ``path``.
    """

    paths: list | None = None  # checked with the files it names (loong.llm.data.indexed.parse_blend)
    split: Annotated[str, Check(note="up to three train,valid,test weights, train > 0")] = "969,30,1"
    on_error: Literal["raise", "skip"] = "raise"
    chat_format: Literal["auto", "messages", "sharegpt", "alpaca"] = "auto"
    chat_template: NonEmptyStr = "auto"  # a name or a .jinja file (loong.llm.sft.templates.check_template_name)
    packing: bool = True
    overlong: Literal["truncate", "drop"] = "truncate"

    def validate(self, path: str) -> None:
        split_weights(self.split)


@dataclass
class LLMRunConfig(RunConfig):
    """``loong-llm train`` config: ``model`` is a :class:`DenseModelConfig`."""

    model: DenseModelConfig = field(default_factory=DenseModelConfig)
    data: LLMDataConfig = field(default_factory=LLMDataConfig)
