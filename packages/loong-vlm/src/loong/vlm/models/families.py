"""Which code serves each encoder / projector family: one table, so the assembly, the task and the HF mapping look a
family up instead of branching on its name.

A vision family module (``loong.vlm.models.<family>``) exposes ``build_encoder(enc_cfg)``, ``build_projector(proj_cfg,
enc_cfg)``, ``hf_to_native`` / ``native_to_hf`` (the vision side's HF keys, relative to :attr:`VisionFamily.hf_prefix`)
and the config conversions; :func:`vision_family` imports it on first use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from loong.core.errors import LoongError, did_you_mean


@dataclass(frozen=True)
class VisionFamily:
    """An encoder family, the projector families it feeds, and where its code and HF keys are."""

    encoder: str
    projectors: tuple[str, ...]
    module: str
    #: the prefix of the vision side's keys in the composite HF model's state dict (what the family's mapping
    #: takes its keys relative to)
    hf_prefix: str

    def load(self) -> ModuleType:
        """The family's module (imported now)."""
        return importlib.import_module(self.module)


VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen2_5_vit": VisionFamily("qwen2_5_vit", ("qwen2_5_merger",), "loong.vlm.models.qwen2_5_vl", "model.visual."),
    "qwen3_vit": VisionFamily("qwen3_vit", ("qwen3_merger",), "loong.vlm.models.qwen3_vl", "model.visual."),
    "intern_vit": VisionFamily("intern_vit", ("internvl_mlp",), "loong.vlm.models.internvl", "model."),
    "siglip2": VisionFamily("siglip2", ("mlp",), "loong.vlm.models.siglip2", ""),
}


def vision_family(encoder_family: str, projector_family: str | None = None) -> VisionFamily:
    """The :class:`VisionFamily` of ``encoder_family``; ``projector_family`` (when given) must be one it feeds."""
    family = VISION_FAMILIES.get(encoder_family)
    if family is None:
        raise LoongError(f"encoder.family: {encoder_family!r} is not one of {', '.join(VISION_FAMILIES)}"
                         f"{did_you_mean(encoder_family, VISION_FAMILIES)}")
    if projector_family is not None and projector_family not in family.projectors:
        raise LoongError(f"projector.family={projector_family} does not take encoder.family={encoder_family}'s "
                         f"features (it takes: {', '.join(family.projectors)})")
    return family


__all__ = ["VISION_FAMILIES", "VisionFamily", "vision_family"]
