"""The run schema of ``loong-llm``: the core run config with a typed dense-model section."""

from __future__ import annotations

from dataclasses import dataclass, field

from loong.core.config.schema import RunConfig
from loong.llm.models.config import DenseModelConfig


@dataclass
class LLMRunConfig(RunConfig):
    """``loong-llm train`` config: ``model`` is a :class:`DenseModelConfig`."""

    model: DenseModelConfig = field(default_factory=DenseModelConfig)
