"""GR00T N1.7 (lerobot 0.6.1's GR00T): Cosmos-Reason2-2B / Qwen3-VL backbone truncated at ``select_layer``,
4-layer VL self-attention, 32-layer alternate-VL DiT flow-matching head with per-embodiment encoders/decoder.

- :mod:`.config`: :class:`GrootN17Config` and the presets ``tiny`` (CPU) and ``groot_n1_7`` (published 3B shape)
- :mod:`.model`: :class:`GrootN17Policy`; :mod:`.processor`: :class:`GrootN17Processor`
- :mod:`.lerobot`: ``to_lerobot`` / ``from_lerobot`` (lerobot ``GrootPolicy`` names and config)
- :mod:`.tiny_processor`: the tiny Qwen3-VL-style processor of the ``tiny`` preset
"""

from loong.embodied.policies.base import PolicySpec
from loong.embodied.policies.groot_n1_7.config import PRESETS, GrootN17Config
from loong.embodied.policies.groot_n1_7.model import GrootN17Policy
from loong.embodied.policies.groot_n1_7.processor import GrootN17Processor

SPEC = PolicySpec(name="groot_n1_7", config_class=GrootN17Config, policy_class=GrootN17Policy,
                  processor_class=GrootN17Processor, presets=PRESETS,
                  lerobot="loong.embodied.policies.groot_n1_7.lerobot")

__all__ = ["SPEC", "GrootN17Config", "GrootN17Policy", "GrootN17Processor"]
