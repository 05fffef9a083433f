"""The data-dependent tensors of GR00T N1.6's Eagle backbone, computed on the host where the data already is.

The former step derived them on the device with host reads or host data: the SigLIP2 tower built its
``spatial_shapes`` with ``torch.tensor`` (a host-to-device copy) and checked them with device reads, the image
tokens were counted against the cameras (a read) and filled by ``masked_scatter`` (whose backward reads a count),
and ``Qwen3Model`` asked whether the padding mask was all ones (a read). None of that can run inside a captured
CUDA graph, so :class:`~.processor.GrootN16Processor` (in the DataLoader's workers) emits these with the batch:

========================  ==============================  ===================================================
key                       shape, dtype                    what
========================  ==============================  ===================================================
``image_token_index``     ``[b * cameras * tokens]`` long flat ``b * s`` positions of the image tokens,
                                                          ascending (sample 0's first: the order of the
                                                          image features, camera by camera)
``vision_pos_weights``    ``[patches, num_patches]`` fp32 the bilinear (antialiased) taps that resize the
                                                          learned position table to one image's patch grid
========================  ==============================  ===================================================

The resize weights are transformers' own: :func:`position_resize_weights` runs
``Siglip2VisionEmbeddings.resize_positional_embeddings`` on the identity table (every resize transformers has
shipped for SigLIP2 is linear in the table, so the identity's image is its matrix, exactly: each entry is one
weight times 1 plus zeros). The step multiplies the table by it as transformers' resize does. The processor
resizes every camera to ``image_size``, so one matrix serves all the images of a batch. The padding mask needs
nothing precomputed: :func:`causal_padding_mask` builds the one ``Qwen3Model`` builds, on the device, without
asking whether there is padding.
"""

from __future__ import annotations

import torch

from loong.core.errors import LoongError
from loong.embodied.policies.groot_n1_6.config import GrootN16Config

IMAGE_INDEX_KEY = "image_token_index"
POS_WEIGHT_KEY = "vision_pos_weights"
#: every precomputed key (the processor emits both; the policy takes them when both are there)
PRECOMPUTED_KEYS = (IMAGE_INDEX_KEY, POS_WEIGHT_KEY)


def patch_grid(image_size: tuple[int, int], patch_size: int) -> tuple[int, int]:
    """The SigLIP2 patch grid ``(rows, columns)`` of an image of ``image_size``."""
    return image_size[0] // patch_size, image_size[1] // patch_size


def position_resize_weights(grid: tuple[int, int], num_patches: int) -> torch.Tensor:
    """``[grid rows * grid columns, num_patches]`` fp32: row ``i`` holds the weights with which transformers'
    SigLIP2 resize makes patch ``i``'s position embedding from the ``sqrt(num_patches)``-square learned table
    (see the module docstring). Host only."""
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionEmbeddings

    side = round(num_patches ** 0.5)
    if side * side != num_patches:
        raise LoongError(f"groot_n1_6.vision_num_patches: {num_patches} must be a square")
    rows, cols = grid
    identity = torch.eye(num_patches, dtype=torch.float32).reshape(side, side, num_patches)
    shapes = torch.tensor([[rows, cols]], dtype=torch.long)
    weights = Siglip2VisionEmbeddings.resize_positional_embeddings(identity, shapes, max_length=rows * cols)
    return weights[0].float().contiguous()


def image_token_index(input_ids: torch.Tensor, image_token_id: int, per_sample: int, *,
                      where: str = "groot_n1_6 inputs") -> torch.Tensor:
    """The flat positions of ``input_ids``' image tokens (host, ascending), after checking that every sample has
    ``per_sample`` of them (its cameras' image features); a LoongError names ``input_ids`` otherwise."""
    ids = input_ids.cpu()
    counts = (ids == image_token_id).sum(dim=1)
    if bool((counts != per_sample).any()):
        raise LoongError(f"{where}: input_ids has {counts.tolist()} image tokens per sample; the cameras' image "
                         f"features need {per_sample} each (prompt and image_size disagree)")
    return (ids.flatten() == image_token_id).nonzero().flatten()


def precompute(input_ids: torch.Tensor, config: GrootN16Config, cameras: int, *,
               where: str = "groot_n1_6 inputs",
               pos_weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The :data:`PRECOMPUTED_KEYS` tensors of a batch of ``cameras`` images per sample at ``config.image_size``
    (on the host; ``pos_weights``: the resize matrix when the caller has it already)."""
    if pos_weights is None:
        pos_weights = position_resize_weights(patch_grid(config.image_size, config.patch_size),
                                              config.vision_num_patches)
    index = image_token_index(input_ids, config.image_token_id, cameras * config.tokens_per_image, where=where)
    return {IMAGE_INDEX_KEY: index, POS_WEIGHT_KEY: pos_weights}




def check_image_index(index: torch.Tensor, tokens: int, where: str = "groot_n1_6 inputs") -> None:
    """Refuse an :data:`IMAGE_INDEX_KEY` tensor that is not ``[tokens]`` long (shape and dtype only: no read)."""
    if index.dim() != 1 or index.shape[0] != tokens or index.dtype != torch.long:
        raise LoongError(f"{where}: '{IMAGE_INDEX_KEY}' is {index.dtype} of shape {list(index.shape)}; the batch's "
                         f"image features need a long tensor of [{tokens}] (made by GrootN16Processor)")


def check_pos_weights(pos_weights: torch.Tensor, patches: int, num_patches: int,
                      where: str = "groot_n1_6 inputs") -> None:
    """Refuse a :data:`POS_WEIGHT_KEY` tensor that does not fit images of ``patches`` patches (shape only)."""
    if tuple(pos_weights.shape) != (patches, num_patches) or not pos_weights.is_floating_point():
        raise LoongError(f"{where}: '{POS_WEIGHT_KEY}' is {pos_weights.dtype} of shape {list(pos_weights.shape)}; "
                         f"images of {patches} patches and a table of {num_patches} positions need a float tensor "
                         f"of [{patches}, {num_patches}] (made by GrootN16Processor for its image_size)")


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[b, 1, s, s]`` bool, True where a query may attend: causal over the non-padding keys. It is the mask
    transformers' ``create_causal_mask`` gives SDPA for a padded batch, built without its "is there padding at
    all" read (a batch without padding then runs SDPA with this mask instead of ``is_causal``)."""
    s = attention_mask.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


def resized_positions(table: torch.Tensor, pos_weights: torch.Tensor, images: int) -> torch.Tensor:
    """``[images, patches, dim]`` position embeddings of ``images`` images from the learned ``[num_patches, dim]``
    table: the weights, one copy per image, times the table in fp32, cast back (transformers' resize, op for op,
    so the numbers and the table's gradient are its own)."""
    weights = pos_weights.to(torch.float32).expand(images, -1, -1)
    return (weights @ table.float()).to(table.dtype)


__all__ = ["IMAGE_INDEX_KEY", "POS_WEIGHT_KEY", "PRECOMPUTED_KEYS", "causal_padding_mask",
           "check_image_index", "check_pos_weights", "image_token_index", "patch_grid", "position_resize_weights", "precompute",
           "resized_positions"]
