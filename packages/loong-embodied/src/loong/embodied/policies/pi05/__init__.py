"""Pi0.5 (Physical Intelligence's openpi; lerobot ``PI05Policy``): config, model, processor and LeRobot mapping.

Presets: ``tiny`` (CPU, 64² images, trains in seconds) and ``pi05`` (the published shape).
"""

from loong.embodied.policies.base import PolicySpec
from loong.embodied.policies.pi05.config import Pi05Config, published, tiny
from loong.embodied.policies.pi05.model import Pi05Policy
from loong.embodied.policies.pi05.processor import Pi05Processor

SPEC = PolicySpec(
    name="pi05",
    config_class=Pi05Config,
    policy_class=Pi05Policy,
    processor_class=Pi05Processor,
    presets={"tiny": tiny(), "pi05": published()},
    lerobot="loong.embodied.policies.pi05.lerobot",
)

__all__ = ["SPEC", "Pi05Config", "Pi05Policy", "Pi05Processor"]
