"""Config: Hydra composition over plugin config groups, validated by typed dataclass schemas."""

from loong.core.config.compose import compose_config, config_groups
from loong.core.config.schema import (
    DataConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
    from_dict,
    to_dict,
)

__all__ = [
    "DataConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "RunConfig",
    "TrainConfig",
    "compose_config",
    "config_groups",
    "from_dict",
    "to_dict",
]
