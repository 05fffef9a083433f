"""A VLM as one megatron pipeline chunk: the vision **encoder** and **projector** (plain modules, on the chunk with
the embedding; with ``encoder.decoupled=true`` a replica on every stage) in front of the **foundation** (loong-llm's megatron GPT as :class:`~loong.vlm.models.foundation.
VLMFoundation`).

The chunk's children are named ``encoder``, ``projector`` and ``foundation``, so its checkpoint keys (megatron's
sharded keys) are ``encoder.*``, ``projector.*`` (the vision families' native keys) and ``foundation.*`` (loong-llm's
keys), the names the HF mapping composes. Images and videos go through the tower separately (their own grids), and
their embeddings are interleaved in token order: the ``k``-th placeholder token of the micro-batch (row-major over
``[b, s]``) takes the ``k``-th row of its modality's embeddings, as transformers' ``masked_scatter`` of the image
and then the video features does.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from torch import nn

from loong.core.errors import LoongError
from loong.vlm.models.foundation import VLMFoundation
from loong.vlm.models.vision.common import ProjectorOutput
from loong.vlm.models.vision.tensor_parallel import is_sharded, shard_sharded_state_dict

Tensor = torch.Tensor
IMAGE, VIDEO = 1, 2  # mm_token_type_ids of image and video placeholder tokens


def interleave(mm_token_type_ids: Tensor, image: Tensor | None, video: Tensor | None) -> Tensor:
    """Rows of ``image`` and ``video`` embeddings in token order: the ``k``-th placeholder token of
    ``mm_token_type_ids`` (1 image / 2 video, 0 text; any shape, row-major) takes the next row of its modality.

    Sync-free: the sizes are the embeddings' row counts (known on the host), the order comes from cumulative sums
    and a sorted search, never from boolean indexing (which would wait for the device to count the tokens). The
    counts must match the placeholder tokens (:meth:`VisionLanguageModel.visual_inputs` checks them)."""
    if video is None or video.shape[0] == 0:
        assert image is not None
        return image
    if image is None or image.shape[0] == 0:
        return video
    n_image, n = image.shape[0], image.shape[0] + video.shape[0]
    flat = mm_token_type_ids.reshape(-1)
    # the flat position of the k-th placeholder (k < n): where the running count of placeholders reaches k + 1
    where = torch.searchsorted((flat > 0).cumsum(0), torch.arange(1, n + 1, device=flat.device))
    is_image = flat[where.clamp(max=flat.numel() - 1)] == IMAGE
    source = torch.where(is_image, is_image.cumsum(0) - 1, n_image + (~is_image).cumsum(0) - 1)
    return torch.cat([image, video.to(image.dtype)]).index_select(0, source)


def media_token_counts(mm_token_type_ids: Tensor) -> tuple[int, int]:
    """``(image, video)`` placeholder tokens of ``mm_token_type_ids``: host metadata (the training task counts
    the CPU batch before moving it; on a device tensor this is a device-to-host sync)."""
    return int((mm_token_type_ids == IMAGE).sum()), int((mm_token_type_ids == VIDEO).sum())


class VisionLanguageModel(MegatronModule):
    """``encoder`` + ``projector`` (None on chunks without the embedding) + ``foundation``.

    ``forward`` takes the micro-batch keys of :mod:`loong.vlm.data.dataset` (``tokens``, ``position_ids``,
    ``document_ids``, ``labels``, ``mm_token_type_ids``, the pixel tensors and grids) and returns the foundation's
    per-token losses ``[b, s]`` (or logits without labels). ``encoder.decoupled=true`` (pp > 1): every stage's
    chunk holds a replica of the tower (``tower_replica`` its pipeline rank, 0 on the first stage), run outside
    the schedule by :mod:`loong.vlm.models.decoupled`; the first stage then takes the visual embeddings ready-made
    (``visual_embeds`` / ``deepstack_embeds``).
    """

    def __init__(self, config: Any, foundation: VLMFoundation, encoder: nn.Module | None = None,
                 projector: nn.Module | None = None, tower_replica: int = 0) -> None:
        super().__init__(config=config)
        #: decoupled encoder: this rank's pipeline rank when the chunk holds a replica of the tower (0: the main
        #: copy, saved; > 0: a replica of it, whose checkpoint keys are marked as such so only stage 0 writes them)
        self.tower_replica = tower_replica
        self.model_type = ModelType.encoder_or_decoder
        if (encoder is None) != (projector is None):
            raise LoongError("a VLM chunk holds both the encoder and the projector or neither")
        self.encoder = encoder
        self.projector = projector
        self.foundation = foundation

    # megatron's schedules and finalize_model_grads ask the innermost module for these (the foundation's)
    @property
    def pre_process(self) -> bool:
        return self.foundation.pre_process

    @property
    def post_process(self) -> bool:
        return self.foundation.post_process

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.foundation.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self) -> Tensor:
        """The tied embedding / output weight (megatron all-reduces its gradient between the first and last
        pipeline stages)."""
        return self.foundation.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Pipeline stages after the first take the previous stage's hidden states (megatron's schedules)."""
        self.foundation.set_input_tensor(input_tensor)

    def enable_fp8_output_layer(self) -> bool:
        """``precision.fp8_output_layer``: the foundation's (loong-llm's ``LoongGPTModel.enable_fp8_output_layer``)."""
        return self.foundation.enable_fp8_output_layer()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """megatron's sharded state: a tensor-parallel encoder's shards (``encoder.parallel.tp > 1``) as slices of
        the whole tensors (:func:`~loong.vlm.models.vision.tensor_parallel.shard_sharded_state_dict`), and the
        tower's tensors marked as replicas on pipeline ranks > 0 (decoupled: every stage holds the same
        ``encoder.*`` / ``projector.*``; one main copy per key, as megatron's checkpointing and
        :func:`~loong.core.engines.megatron.state.gather_full_state` require)."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if is_sharded(self.encoder):
            shard_sharded_state_dict(sd, f"{prefix}encoder.", self.encoder)
        if self.tower_replica:
            from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

            tower = (f"{prefix}encoder.", f"{prefix}projector.")

            def mark(x: Any) -> Any:
                if getattr(x, "key", "").startswith(tower) and hasattr(x, "replica_id"):
                    rid = x.replica_id if isinstance(x.replica_id, tuple) else (x.replica_id,)
                    x.replica_id = (rid[0] + self.tower_replica, *rid[1:])  # same arity, never all zeros
                return x

            dict_list_map_inplace(mark, sd)
        return sd

    def vision_dtype(self) -> torch.dtype:
        """The dtype the tower computes in (its parameters', bf16 under megatron's Float16Module)."""
        assert self.encoder is not None
        return next(self.encoder.parameters()).dtype

    def embed_media(self, pixel_values: Tensor | None, grid_thw: Tensor | None) -> ProjectorOutput | None:
        """The projected features of one modality's media (None when there are none)."""
        if pixel_values is None or pixel_values.shape[0] == 0:
            return None
        assert self.encoder is not None and self.projector is not None
        pixels = pixel_values.to(self.vision_dtype())
        return self.projector(self.encoder(pixels, grid_thw), grid_thw)

    def visual_inputs(self, mm_token_type_ids: Tensor, pixel_values: Tensor | None = None,
                      image_grid_thw: Tensor | None = None, pixel_values_videos: Tensor | None = None,
                      video_grid_thw: Tensor | None = None,
                      media_tokens: tuple[int, int] | None = None) -> tuple[Tensor | None, list[Tensor]]:
        """``(visual_embeds [n, d], deepstack_embeds)`` for the placeholder tokens of ``mm_token_type_ids``.

        Qwen processors give images and videos as separate tensors; InternVL's ``pixel_values`` already hold the
        image tiles and video frames in token order (``pixel_values_videos`` None). ``media_tokens``: the
        ``(image, video)`` placeholder counts known on the host (:func:`media_token_counts` of the CPU batch; the
        training task passes them), None: counted here (a device sync).
        """
        n_image, n_video = media_token_counts(mm_token_type_ids) if media_tokens is None else media_tokens
        if n_image + n_video == 0:
            return None, []
        if pixel_values_videos is None:  # one tensor in token order (InternVL), or images only
            out = self.embed_media(pixel_values, image_grid_thw)
            if out is None:
                raise LoongError(f"the micro-batch has {n_image + n_video} media placeholder tokens but no pixels")
            return out.embeds, list(out.deepstack)
        images = self.embed_media(pixel_values, image_grid_thw)
        videos = self.embed_media(pixel_values_videos, video_grid_thw)
        for name, out, want in (("image", images, n_image), ("video", videos, n_video)):
            got = 0 if out is None else out.embeds.shape[0]
            if got != want:
                raise LoongError(f"the micro-batch has {want} {name} placeholder tokens but its pixels give {got} "
                                 f"{name} embeddings (processor and encoder geometry disagree)")
        mm = mm_token_type_ids
        embeds = interleave(mm, images.embeds if images else None, videos.embeds if videos else None)
        depth = max(len(images.deepstack) if images else 0, len(videos.deepstack) if videos else 0)
        deepstack = [interleave(mm, images.deepstack[i] if images else None,
                                videos.deepstack[i] if videos else None) for i in range(depth)]
        return embeds, deepstack

    def forward(self, tokens: Tensor, position_ids: Tensor, document_ids: Tensor | None = None,
                labels: Tensor | None = None, *, mm_token_type_ids: Tensor | None = None,
                pixel_values: Tensor | None = None, image_grid_thw: Tensor | None = None,
                pixel_values_videos: Tensor | None = None, video_grid_thw: Tensor | None = None,
                visual_embeds: Tensor | None = None, deepstack_embeds: list[Tensor] | None = None,
                media_tokens: tuple[int, int] | None = None) -> Tensor:
        """Per-token losses ``[b, s]`` given ``labels``, else logits. Media keys are read on the first stage only.
        ``media_tokens``: the ``(image, video)`` placeholder counts known on the host (see :meth:`visual_inputs`);
        with them the forward never waits for the device."""
        deepstack: list[Tensor] = list(deepstack_embeds or ())
        visual_mask = None
        if self.foundation.pre_process and mm_token_type_ids is not None:
            if visual_embeds is None and self.encoder is not None:
                visual_embeds, deepstack = self.visual_inputs(mm_token_type_ids, pixel_values, image_grid_thw,
                                                              pixel_values_videos, video_grid_thw, media_tokens)
            if visual_embeds is not None:
                visual_mask = mm_token_type_ids > 0
                dtype = self.foundation.embedding.word_embeddings.weight.dtype
                visual_embeds = visual_embeds.to(dtype)
                deepstack = [d.to(dtype) for d in deepstack]
        return self.foundation(tokens, position_ids, document_ids, labels=labels,
                               visual_embeds=visual_embeds, visual_mask=visual_mask,
                               deepstack_embeds=deepstack or None,
                               visual_count=None if media_tokens is None else sum(media_tokens))


__all__ = ["IMAGE", "VIDEO", "VisionLanguageModel", "interleave", "media_token_counts"]
