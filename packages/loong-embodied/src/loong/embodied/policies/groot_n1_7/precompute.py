"""The data-dependent index tensors of GR00T N1.7's backbone, computed where the data already is: on the host.

Qwen3-VL's forward derives several tensors from ``input_ids`` and ``image_grid_thw`` with host loops and reads
(``.tolist()``, ``nonzero``, boolean masks): on a GPU each one stops the host until the device catches up, and
none can run inside a captured CUDA graph. :class:`~.processor.GrootN17Processor` (in the DataLoader's workers)
therefore emits them with the batch, and the policy's device step only gathers and adds with them:

==========================  =========================  =====================================================
key                         shape, dtype               what
==========================  =========================  =====================================================
``mrope_position_ids``      ``[3, b, s]`` long         the text model's M-RoPE ids (transformers'
                                                       ``get_rope_index``; 0 at padding)
``vision_position_ids``     ``[patches, 2]`` long      the vision rotary (row, column) of each patch
``vision_interp_indices``   ``[patches, 4]`` long      the learned position grid's bilinear taps per patch
``vision_interp_weights``   ``[patches, 4]`` fp32      and their weights
``vision_cu_seqlens``       ``[images + 1]`` int32     the images' boundaries in the packed patches
``image_token_index``       ``[image tokens]`` long    flat ``b * s`` positions of the image tokens, ascending
==========================  =========================  =====================================================

The vision tensors are transformers' own (``transformers.vision_utils``, the functions ``Qwen3VLVisionModel.forward``
calls and whose ``kwargs`` it takes precomputed, in 5.17 as in 5.24); the M-RoPE ids are :func:`mrope_position_ids`,
checked against transformers' ``compute_3d_position_ids``. Every size is a function of the batch's shapes: the image
tokens number ``patches / spatial_merge_size**2``, so a batch of the same shapes gives tensors of the same shapes.
:func:`precompute` also validates what the policy used to check with device reads (each image's token count
against its grid) and the processor checks that every image has the same size, which lets the vision attention
take its per-image length from the shapes (:func:`max_image_patches`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loong.core.errors import LoongError

MROPE_KEY = "mrope_position_ids"
VISION_POSITION_KEY = "vision_position_ids"
INTERP_INDEX_KEY = "vision_interp_indices"
INTERP_WEIGHT_KEY = "vision_interp_weights"
CU_SEQLENS_KEY = "vision_cu_seqlens"
IMAGE_INDEX_KEY = "image_token_index"
#: every precomputed key (the processor emits all of them; the policy uses them when all are there)
PRECOMPUTED_KEYS = (MROPE_KEY, VISION_POSITION_KEY, INTERP_INDEX_KEY, INTERP_WEIGHT_KEY, CU_SEQLENS_KEY,
                    IMAGE_INDEX_KEY)
#: ``mm_token_type_ids`` values (transformers' convention)
TEXT, IMAGE, VIDEO = 0, 1, 2


@dataclass(frozen=True)
class BackboneGeometry:
    """The backbone config values the precomputation reads (from the ``Qwen3VLConfig`` the policy is built from).

    The pos-embed interpolation mode and corner alignment are ``Qwen3VLVisionModel``'s fixed attributes
    (``interpolation_mode="bilinear"``, ``interpolation_align_corners=True``).
    """

    image_token_id: int
    video_token_id: int
    spatial_merge_size: int
    num_grid_per_side: int
    interpolation_mode: str = "bilinear"
    interpolation_align_corners: bool = True

    @classmethod
    def of(cls, qwen_config: Any) -> BackboneGeometry:
        """From a ``Qwen3VLConfig`` (or any object with its ``image_token_id`` / ``vision_config`` fields)."""
        vision = qwen_config.vision_config
        return cls(image_token_id=int(qwen_config.image_token_id), video_token_id=int(qwen_config.video_token_id),
                   spatial_merge_size=int(vision.spatial_merge_size),
                   num_grid_per_side=int(vision.num_position_embeddings ** 0.5))

    @classmethod
    def of_backbone_dict(cls, backbone: Mapping[str, Any]) -> BackboneGeometry:
        """From the ``Qwen3VLConfig`` keyword arguments (``GrootN17Config.backbone_dict()``)."""
        from transformers import Qwen3VLConfig

        return cls.of(Qwen3VLConfig(**backbone))


def token_types(input_ids: torch.Tensor, geometry: BackboneGeometry) -> torch.Tensor:
    """``mm_token_type_ids`` from the token ids (text 0, image 1, video 2), for inputs made without them."""
    return ((input_ids == geometry.image_token_id).int() + 2 * (input_ids == geometry.video_token_id).int())


def mrope_position_ids(input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor,
                       attention_mask: torch.Tensor | None, spatial_merge_size: int, *,
                       where: str = "groot_n1_7 inputs") -> torch.Tensor:
    """``[3, b, s]`` M-RoPE position ids of Qwen3-VL, on the host (transformers' ``get_rope_index`` for images).

    Over each sample's valid tokens, in order: a text run of ``n`` tokens takes positions ``p .. p+n-1`` on all
    three rows; an image run (one image: its ``t * h * w / merge**2`` tokens) takes ``p + (t, h, w)`` index grids
    of its merged grid, and the next position is ``p + max(h, w) / merge``. Padding keeps 0. A LoongError names
    ``image_grid_thw`` when an image run's length is not its grid's token count or runs and grids do not pair up.
    """
    input_ids, types, grid = input_ids.cpu(), mm_token_type_ids.cpu(), image_grid_thw.cpu()
    b, s = input_ids.shape
    out = torch.zeros(3, b, s, dtype=input_ids.dtype)
    grids = iter(grid.tolist())
    used = 0
    for i in range(b):
        valid = (attention_mask[i].cpu().bool() if attention_mask is not None
                 else torch.ones(s, dtype=torch.bool))
        pieces, pos = [], 0
        for kind, run in itertools.groupby(types[i][valid].tolist()):
            n = len(list(run))
            if kind == TEXT:
                pieces.append(torch.arange(n).view(1, -1).expand(3, -1) + pos)
                pos += n
                continue
            if kind != IMAGE:
                raise LoongError(f"{where}: video tokens in input_ids (mm_token_type_ids {kind}); GR00T N1.7 takes "
                                 "images only")
            thw = next(grids, None)
            if thw is None:
                raise LoongError(f"{where}: more image-token runs in input_ids than images in image_grid_thw "
                                 f"({grid.shape[0]})")
            used += 1
            t, h, w = thw[0], thw[1] // spatial_merge_size, thw[2] // spatial_merge_size
            if t * h * w != n:
                raise LoongError(f"{where}: image {used - 1} has {n} image tokens in input_ids but its "
                                 f"image_grid_thw {thw} makes {t * h * w} features")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(h, w)
        if pieces:
            out[:, i, valid] = torch.cat(pieces, dim=1).to(out.dtype)
    if used != grid.shape[0]:
        raise LoongError(f"{where}: image_grid_thw has {grid.shape[0]} images but input_ids {used} image-token runs")
    return out


def precompute(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               mm_token_type_ids: torch.Tensor | None, image_grid_thw: torch.Tensor, geometry: BackboneGeometry, *,
               where: str = "groot_n1_7 inputs") -> dict[str, torch.Tensor]:
    """The :data:`PRECOMPUTED_KEYS` tensors of one batch (on the host, whatever device the inputs are on)."""
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    input_ids, grid = input_ids.cpu(), image_grid_thw.cpu()
    types = token_types(input_ids, geometry) if mm_token_type_ids is None else mm_token_type_ids.cpu()
    merge = geometry.spatial_merge_size
    positions = mrope_position_ids(input_ids, types, grid, attention_mask, merge, where=where)
    index = (input_ids.flatten() == geometry.image_token_id).nonzero().flatten()
    features = int(grid.prod(-1).sum()) // merge**2
    if index.numel() != features:
        raise LoongError(f"{where}: {index.numel()} image tokens in input_ids but {features} image features from "
                         "pixel_values / image_grid_thw")
    interp_indices, interp_weights = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=geometry.num_grid_per_side, mode=geometry.interpolation_mode,
        align_corners=geometry.interpolation_align_corners, spatial_merge_size=merge)
    return {MROPE_KEY: positions, VISION_POSITION_KEY: get_vision_position_ids(grid, merge),
            INTERP_INDEX_KEY: interp_indices, INTERP_WEIGHT_KEY: interp_weights,
            CU_SEQLENS_KEY: get_vision_cu_seqlens(grid), IMAGE_INDEX_KEY: index}


def check_one_image_size(image_grid_thw: torch.Tensor, where: str) -> None:
    """Refuse images of different sizes (the precomputed inputs' vision attention takes one per-image length)."""
    if image_grid_thw.shape[0] and not bool((image_grid_thw == image_grid_thw[:1]).all()):
        raise LoongError(f"{where}: image_grid_thw has images of different sizes ({image_grid_thw.tolist()}); "
                         "GR00T N1.7's inputs resize every camera to image_target_size")




def max_image_patches(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                      cu_seqlens: torch.Tensor | None = None) -> int:
    """The longest image's patch count, as a host integer: from the shapes when ``cu_seqlens`` is None (every image
    the same size, which the processor checks), else read from ``cu_seqlens`` (a device read)."""
    if cu_seqlens is None:
        return pixel_values.shape[0] // max(1, image_grid_thw.shape[0])
    return int(cu_seqlens.diff().max())


__all__ = ["CU_SEQLENS_KEY", "IMAGE_INDEX_KEY", "INTERP_INDEX_KEY", "INTERP_WEIGHT_KEY", "MROPE_KEY",
           "PRECOMPUTED_KEYS", "VISION_POSITION_KEY", "BackboneGeometry", "check_one_image_size",
           "max_image_patches", "mrope_position_ids", "precompute", "token_types"]
