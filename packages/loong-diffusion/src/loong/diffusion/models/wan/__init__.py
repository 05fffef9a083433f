"""Wan 2.1 / 2.2 video diffusion transformers (T2V, I2V, TI2V, the A14B experts) in plain PyTorch, with context
parallelism through ``loong.core.attention`` and the diffusers ``WanTransformer3DModel`` mapping.

- :mod:`.config`: :class:`WanConfig`, :data:`PRESETS` (``tiny`` … the published shapes), parameter counts;
- :mod:`.model`: :class:`WanTransformer` (its parts in :mod:`.embeddings`, :mod:`.rope`, :mod:`.attention`,
  :mod:`.block`, :mod:`.norms`);
- :mod:`.mapping`: the diffusers names (declared once), config fields and folder format (load and save).
"""

from loong.diffusion.models.wan.config import PRESETS, WanConfig, wan_preset
from loong.diffusion.models.wan.mapping import (
    config_from_diffusers,
    config_to_diffusers,
    from_diffusers,
    load_diffusers,
    save_diffusers,
    to_diffusers,
)
from loong.diffusion.models.wan.model import WanTransformer

__all__ = ["PRESETS", "WanConfig", "WanTransformer", "config_from_diffusers", "config_to_diffusers",
           "from_diffusers", "load_diffusers", "save_diffusers", "to_diffusers", "wan_preset"]
