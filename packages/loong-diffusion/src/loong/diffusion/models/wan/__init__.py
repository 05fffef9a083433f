"""Wan 2.1 / 2.2 video diffusion transformers (T2V, I2V, TI2V, the A14B experts) in plain PyTorch, with context
parallelism through ``loong.core.attention`` and the diffusers ``WanTransformer3DModel`` mapping.

- :mod:`.config`: :class:`WanConfig`, :data:`PRESETS` (``tiny`` … the published shapes), parameter counts;
- :mod:`.model`: :class:`WanTransformer` (its parts in :mod:`.embeddings`, :mod:`.rope`, :mod:`.attention`,
  :mod:`.block`, :mod:`.norms`);
- :mod:`.packed`: several clips of different sizes in one sequence (:meth:`WanTransformer.forward_packed`);
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
from loong.diffusion.models.wan.packed import PACK_INPUTS, pack_clips, packed_mse, unpack_tokens

__all__ = ["PACK_INPUTS", "PRESETS", "WanConfig", "WanTransformer", "config_from_diffusers", "config_to_diffusers",
           "from_diffusers", "load_diffusers", "pack_clips", "packed_mse", "save_diffusers", "to_diffusers",
           "unpack_tokens", "wan_preset"]
