"""loong-llm's megatron GPT model as a VLM's language model (the **foundation**): multimodal inputs, M-RoPE and
DeepStack on top of :class:`~loong.llm.models.gpt.LoongGPTModel`; text-only inputs with ``[b, s]`` position ids
take exactly the LLM's path.

- **Multimodal inputs.** ``visual_embeds [n, d]`` replace the word embeddings at ``visual_mask [b, s]`` (True at
  the image / video placeholder tokens). Row ``k`` belongs to the ``k``-th True of the mask in row-major ``[b, s]``
  order, as transformers' ``inputs_embeds.masked_scatter(mask, embeds)``. The replacement happens on megatron's
  embedding output ``[s, b, d]``; under sequence parallelism that is this rank's ``[s/tp, b, d]`` slice, and only
  the rows inside it are placed (their gradient is summed over the tensor-parallel group, so every rank hands the
  encoder the whole gradient, as it does without SP).
- **M-RoPE** (Qwen2-VL / Qwen2.5-VL: ``mrope_section`` chunks; Qwen3-VL: ``mrope_interleaved``) from position ids
  ``[3, b, s]`` (temporal, height, width): every rotary channel takes its frequency from one of the three rows,
  giving per-sample frequencies ``[s, b, 1, d]`` in megatron's layout, so the attention modules (loong-kernels'
  fused RoPE included) take them unchanged. Each frequency is the same single fp32 product transformers computes.
- **DeepStack** (Qwen3-VL): ``deepstack_embeds[i] [n, d]`` is added to the hidden states at the visual positions
  after decoder layer ``i`` (for ``i < len(deepstack_embeds)``), by forward hooks this module registers on those
  layers for the length of one forward. Only layers of the first pipeline stage can take them (the encoder's
  features live there), and not under ``recompute=full`` (megatron re-runs whole layers from its own saved inputs
  in backward, where a hook has no features to add): both are refused when the model is built.

Context parallelism splits the sequence before the model sees it; multimodal inputs under CP are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from loong.core.errors import LoongError
from loong.llm.models.build import build_gpt_model
from loong.llm.models.config import DenseModelConfig
from loong.llm.models.fused import FusedKernels
from loong.llm.models.gpt import LoongGPTModel
from loong.vlm.models.vision.common import host_to_device

Tensor = torch.Tensor


def mrope_channel_rows(mrope_section: Sequence[int], interleaved: bool) -> list[int]:
    """Which position-id row (0 temporal, 1 height, 2 width) each of the ``sum(mrope_section)`` rotary frequencies
    reads.

    Chunked (Qwen2-VL / Qwen2.5-VL): consecutive chunks of ``mrope_section[i]`` channels read row ``i % 3``.
    Interleaved (Qwen3-VL): channels ``1, 4, 7, ...`` (``mrope_section[1]`` of them) read the height row, ``2, 5,
    8, ...`` (``mrope_section[2]``) the width row, the rest the temporal row.
    """
    half = sum(mrope_section)
    if not interleaved:
        return [i % 3 for i, n in enumerate(mrope_section) for _ in range(n)]
    rows = [0] * half
    for row in (1, 2):
        for channel in range(row, min(3 * mrope_section[row], half), 3):
            rows[channel] = row
    return rows


def check_mrope(mrope_section: Sequence[int] | None, interleaved: bool, kv_channels: int,
                path: str = "foundation") -> tuple[int, ...] | None:
    """``mrope_section`` as a tuple after checking it against the head width: three positive channel counts that
    sum to ``kv_channels / 2`` (one per rotary frequency). None = 1-D RoPE (``interleaved`` must then be False)."""
    if mrope_section is None:
        if interleaved:
            raise LoongError(f"{path}.mrope_interleaved=true needs {path}.mrope_section")
        return None
    section = tuple(int(n) for n in mrope_section)
    if len(section) != 3 or min(section) < 1:
        raise LoongError(f"{path}.mrope_section={list(section)}: three positive channel counts "
                         "(temporal, height, width) are needed")
    if sum(section) * 2 != kv_channels:
        raise LoongError(f"{path}.mrope_section={list(section)} sums to {sum(section)} rotary frequencies; the "
                         f"attention heads of width {kv_channels} have {kv_channels // 2}")
    return section


_CHANNEL_ROWS: dict[tuple, Tensor] = {}


def _channel_rows_on(rows: tuple[int, ...], device: torch.device) -> Tensor:
    """``rows`` as an index tensor on ``device``, made once per device (``torch.tensor(..., device=cuda)`` would
    copy from pageable memory and wait for the stream on every forward)."""
    key = (rows, device)
    if key not in _CHANNEL_ROWS:
        _CHANNEL_ROWS[key] = host_to_device(torch.tensor(rows, dtype=torch.int64), device)
    return _CHANNEL_ROWS[key]


def mrope_freqs_from_positions(rope: Any, position_ids: Tensor, channel_rows: Sequence[int]) -> Tensor:
    """Rotary frequencies ``[s, b, 1, d]`` for M-RoPE position ids ``[3, b, s]``.

    ``rope`` is megatron's ``RotaryEmbedding`` (its ``inv_freq``, interpolation factor and (non-)interleaved
    channel layout are used as in :func:`loong.llm.models.gpt.rotary_freqs_from_positions`); frequency ``j`` is
    ``position_ids[channel_rows[j]] * inv_freq[j]``.
    """
    inv_freq = rope.inv_freq.to(position_ids.device)
    if len(channel_rows) != inv_freq.numel():
        raise LoongError(f"M-RoPE assigns {len(channel_rows)} rotary frequencies but the model has "
                         f"{inv_freq.numel()}")
    pos = position_ids.transpose(1, 2).to(inv_freq.dtype)  # [3, s, b]
    if rope.seq_len_interpolation_factor is not None:
        pos = pos * (1 / rope.seq_len_interpolation_factor)
    rows = _channel_rows_on(tuple(channel_rows), pos.device)
    # per channel the position row it reads, [s, b, d/2]; one fp32 product each, as transformers' own
    freqs = pos[rows].permute(1, 2, 0) * inv_freq
    if not rope.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    return emb.unsqueeze(2)


@dataclass(frozen=True)
class VisualPositions:
    """Where the visual rows go in this rank's ``[s_local, b, d]`` hidden states: the token at ``(i, j)`` is a
    visual one where ``mask[i, j]`` and then takes visual row ``rows[i, j]`` (elsewhere ``rows`` holds a harmless
    in-range row whose value is discarded). ``tp_group`` is set under sequence parallelism (the slice holds only
    some of the rows; their gradients are summed over the group).

    Sync-free: every tensor has a shape known on the host (``[s_local, b]``), so the placement is a gather and a
    ``where`` (its gradient an ``index_add``) instead of ``nonzero`` / boolean indexing, which would wait for the
    device to learn how many visual tokens this rank holds."""

    mask: Tensor
    rows: Tensor
    tp_group: Any = None

    @classmethod
    def at(cls, visual_mask: Tensor, index: Tensor, tp_group: Any = None) -> VisualPositions:
        """The positions of ``visual_mask [b, s]`` in hidden states holding the tokens ``index [s_local]`` of the
        whole sequence, in that order (a slice, or a context-parallel rank's two zigzag chunks)."""
        b, s = visual_mask.shape
        ordinal = visual_mask.reshape(-1).cumsum(0).reshape(b, s) - 1  # row of each True, row-major [b, s]
        return cls(mask=visual_mask[:, index].t(), rows=ordinal[:, index].t(), tp_group=tp_group)

    def _values(self, embeds: Tensor, like: Tensor) -> Tensor:
        """``[s_local, b, d]``: visual row ``rows[i, j]`` at every visual token (anything at the others)."""
        if self.tp_group is not None:  # backward: this rank's rows' gradients + the other ranks'
            embeds = copy_to_tensor_model_parallel_region(embeds, group=self.tp_group)
        n = embeds.shape[0]
        # non-visual tokens read rows spread over the table (not all row 0): their zero gradients then add
        # without piling onto one row
        spread = torch.arange(self.rows.numel(), device=self.rows.device).reshape(self.rows.shape) % n
        rows = torch.where(self.mask, self.rows, spread)
        return embeds.to(like.dtype).index_select(0, rows.reshape(-1)).reshape(*rows.shape, embeds.shape[1])

    def replace(self, hidden: Tensor, embeds: Tensor) -> Tensor:
        """``hidden`` with the visual rows in place of its rows at the positions (a new tensor)."""
        if embeds.shape[0] == 0:
            return hidden
        return torch.where(self.mask[..., None], self._values(embeds, hidden), hidden)

    def add(self, hidden: Tensor, embeds: Tensor) -> Tensor:
        """``hidden`` plus the visual rows at the positions (a new tensor)."""
        if embeds.shape[0] == 0:
            return hidden
        values = self._values(embeds, hidden)
        return hidden + torch.where(self.mask[..., None], values, values.new_zeros(()))


def _deepstack_hook(positions: VisualPositions, embeds: Tensor, module: torch.nn.Module, args: Any,
                    output: tuple) -> tuple:
    hidden, *rest = output  # TransformerLayer returns (hidden_states, context)
    return (positions.add(hidden, embeds), *rest)


def first_stage_layers(config: TransformerConfig) -> int:
    """Decoder layers in the model chunk that holds the embedding (pipeline rank 0, virtual stage 0)."""
    vp_stage = 0 if config.virtual_pipeline_model_parallel_size else None
    return get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=0)


def check_deepstack(deepstack_layers: int, config: TransformerConfig) -> None:
    """Refuse a DeepStack depth this layout cannot run (see the module docstring)."""
    if deepstack_layers < 0:
        raise LoongError(f"deepstack_layers={deepstack_layers}: must be >= 0")
    if not deepstack_layers:
        return
    if deepstack_layers > config.num_layers:
        raise LoongError(f"DeepStack feeds the first {deepstack_layers} decoder layers; the foundation has "
                         f"{config.num_layers}")
    first = first_stage_layers(config)
    if deepstack_layers > first:
        pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
        raise LoongError(f"DeepStack feeds the first {deepstack_layers} decoder layers, but the first pipeline stage "
                         f"holds {first} (foundation.parallel.pp={pp}, vpp={vpp}); the visual features live on that "
                         "stage only: lower the pipeline size so it holds them all")
    if config.recompute_granularity == "full":
        raise LoongError("foundation.recompute=full re-runs whole decoder layers in backward, where DeepStack's "
                         "additions cannot be replayed; use foundation.recompute=selective (or none) with DeepStack")


class VLMFoundation(LoongGPTModel):
    """:class:`LoongGPTModel` taking multimodal inputs, M-RoPE position ids and DeepStack features.

    ``mrope_section`` (None: 1-D RoPE only) and ``mrope_interleaved`` select the M-RoPE layout;
    ``deepstack_layers`` is how many leading decoder layers may take DeepStack features (Qwen3-VL:
    ``len(deepstack_visual_indexes)``; 0: none). Other arguments are :class:`LoongGPTModel`'s.
    """

    def __init__(self, config: TransformerConfig, *args: Any, mrope_section: Sequence[int] | None = None,
                 mrope_interleaved: bool = False, deepstack_layers: int = 0, **kwargs: Any) -> None:
        section = check_mrope(mrope_section, mrope_interleaved, config.kv_channels)
        if section is not None and config.multi_latent_attention:
            raise LoongError("M-RoPE (foundation.mrope_section) rotates GPT attention heads; multi-latent attention "
                             "(DeepSeek-V3) computes its own rotary embedding: leave mrope_section unset")
        if section is not None and config.mtp_num_layers:
            raise LoongError("multi-token prediction (foundation.mtp_num_layers) with M-RoPE position ids is not "
                             "supported; set foundation.mtp_num_layers=0")
        check_deepstack(deepstack_layers, config)
        super().__init__(config, *args, **kwargs)
        self.mrope_section = section
        self.mrope_interleaved = bool(mrope_interleaved)
        self.mrope_channel_rows = None if section is None else tuple(mrope_channel_rows(section, mrope_interleaved))
        self.deepstack_layers = deepstack_layers

    # --- rotary -----------------------------------------------------------------------------
    def _preprocess(self, input_ids: Tensor, position_ids: Tensor, decoder_input: Tensor | None = None,
                    inference_context: Any = None, packed_seq_params: Any = None,
                    padding_mask: Tensor | None = None) -> tuple:
        if position_ids is None or position_ids.dim() == 2:
            return super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                       inference_context=inference_context, packed_seq_params=packed_seq_params,
                                       padding_mask=padding_mask)
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise LoongError(f"position_ids of shape {tuple(position_ids.shape)}: expected [b, s] or [3, b, s]")
        if self.mrope_channel_rows is None:
            raise LoongError("position_ids [3, b, s] (M-RoPE) given to a foundation without mrope_section")
        if inference_context is not None or packed_seq_params is not None:
            raise LoongError("M-RoPE position ids are for training / evaluation forwards on [b, s] batches (no "
                             "inference context, no THD packed_seq_params; pack with document ids instead)")
        out = super()._preprocess(input_ids, None, decoder_input=decoder_input, inference_context=None,
                                  packed_seq_params=None, padding_mask=padding_mask)
        emb = mrope_freqs_from_positions(self.rotary_pos_emb, position_ids, self.mrope_channel_rows)
        if out[1] is None or emb.shape[0] != out[1].shape[0]:
            expected = None if out[1] is None else out[1].shape[0]
            raise LoongError(f"position_ids give {emb.shape[0]} rotary positions but the model expects {expected}")
        return (out[0], emb, *out[2:])

    # --- multimodal inputs -------------------------------------------------------------------
    def _visual_positions(self, input_ids: Tensor, visual_mask: Tensor | None, local_len: int) -> VisualPositions:
        """Where the visual rows go in this rank's hidden states. Under context parallelism ``input_ids`` hold this
        CP rank's two zigzag chunks of each row while ``visual_mask`` covers the whole rows (the visual rows are
        numbered over the whole sequence): ``[b, s_local * cp]``."""
        cp = self._cp_size()
        expected = (input_ids.shape[0], input_ids.shape[1] * cp)
        if visual_mask is None:
            raise LoongError("visual_embeds / deepstack_embeds need visual_mask [b, s] (True at placeholder tokens)")
        if visual_mask.dtype != torch.bool or tuple(visual_mask.shape) != expected:
            what = "shaped like input_ids" if cp == 1 else f"over the whole rows (input_ids hold 1/{cp} of them)"
            raise LoongError(f"visual_mask must be a bool tensor {what}: {expected}; got {visual_mask.dtype} "
                             f"{tuple(visual_mask.shape)}")
        index = torch.arange(input_ids.shape[1], device=visual_mask.device)
        if cp > 1:
            from loong.core.engines.megatron.context_parallel import split_for_cp_rank

            whole = torch.arange(expected[1], device=visual_mask.device)
            index = split_for_cp_rank(whole, 0, cp, self.pg_collection.cp.rank())
        if local_len == index.numel():
            return VisualPositions.at(visual_mask, index)
        tp = self.pg_collection.tp  # sequence parallelism: this rank holds tokens [rank * s/tp, (rank+1) * s/tp)
        if local_len * tp.size() != index.numel():
            raise LoongError(f"hidden states hold {local_len} of {index.numel()} tokens, not a 1/{tp.size()} slice")
        return VisualPositions.at(visual_mask, index[tp.rank() * local_len:(tp.rank() + 1) * local_len],
                                  tp_group=tp)

    def _check_rows(self, name: str, embeds: Tensor, count: int) -> None:
        if embeds.dim() != 2 or embeds.shape[0] != count or embeds.shape[1] != self.config.hidden_size:
            raise LoongError(f"{name} has shape {tuple(embeds.shape)}; visual_mask has {count} placeholder tokens "
                             f"and the foundation's hidden size is {self.config.hidden_size}")

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None,
                decoder_input: Tensor | None = None, labels: Tensor | None = None, *,
                visual_embeds: Tensor | None = None, visual_mask: Tensor | None = None,
                deepstack_embeds: Sequence[Tensor] | None = None, visual_count: int | None = None,
                **kwargs: Any) -> Tensor:
        """megatron's GPT forward with multimodal extras.

        ``input_ids [b, s]``; ``position_ids [b, s]`` (1-D RoPE) or ``[3, b, s]`` (M-RoPE); ``attention_mask``
        None (causal) or per-token document ids ``[b, s]`` (packed samples); ``labels [b, s]`` (already shifted)
        gives per-token losses ``[b, s]``, otherwise logits ``[b, s, V/tp]``. On the chunk with the embedding:
        ``visual_embeds [n, d]`` placed at ``visual_mask [b, s]`` (n = its True count), and ``deepstack_embeds``,
        up to ``deepstack_layers`` tensors ``[n, d]``, added after the first decoder layers. ``visual_count``: n as
        known on the host (the VLM's media metadata); None counts the mask, a device-to-host sync. Other keywords
        (``loss_mask``, ``padding_mask``, ...) are megatron's.
        """
        deepstack = list(deepstack_embeds or ())
        if visual_embeds is None and not deepstack:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                                   labels=labels, **kwargs)
        if not self.pre_process:
            raise LoongError("visual_embeds / deepstack_embeds go to the pipeline chunk with the embedding "
                             "(the first stage); this chunk has none")
        if decoder_input is not None:
            raise LoongError("pass either decoder_input or visual_embeds / deepstack_embeds, not both")
        if len(deepstack) > self.deepstack_layers:
            raise LoongError(f"{len(deepstack)} DeepStack feature tensors for a foundation built with "
                             f"deepstack_layers={self.deepstack_layers}")
        padding_mask = kwargs.get("padding_mask")
        decoder_input = self.embedding(input_ids=input_ids, position_ids=None)  # [s(/tp under SP), b, d]
        positions = self._visual_positions(input_ids, visual_mask, decoder_input.shape[0])
        count = int(visual_mask.sum()) if visual_count is None else visual_count
        for i, embeds in enumerate(deepstack):
            self._check_rows(f"deepstack_embeds[{i}]", embeds, count)
        if visual_embeds is not None:
            self._check_rows("visual_embeds", visual_embeds, count)
            decoder_input = positions.replace(decoder_input, visual_embeds)
        if padding_mask is not None and positions.tp_group is not None:
            # megatron slices the padding mask with the embedding only when it embeds the tokens itself
            rank, local = positions.tp_group.rank(), decoder_input.shape[0]
            kwargs["padding_mask"] = padding_mask[:, rank * local:(rank + 1) * local]
        handles = [self.decoder.layers[i].register_forward_hook(partial(_deepstack_hook, positions, embeds))
                   for i, embeds in enumerate(deepstack)]
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                                   labels=labels, **kwargs)
        finally:
            for handle in handles:
                handle.remove()


def build_foundation(
    cfg: DenseModelConfig,
    config: TransformerConfig,
    capabilities: set[str],
    pre_process: bool,
    post_process: bool,
    pg_collection: Any,
    vp_stage: int | None = None,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool = False,
    *,
    deepstack_layers: int = 0,
    fused_kernels: FusedKernels | None = None,
) -> VLMFoundation:
    """One pipeline chunk of the foundation: loong-llm's :func:`~loong.llm.models.build.build_gpt_model` (the same
    layer spec, fused kernels, rope scaling and checkpoint keys) building a :class:`VLMFoundation`.

    ``config`` is :func:`loong.llm.models.build.transformer_config` of ``cfg`` at the foundation's layout;
    ``deepstack_layers`` as :class:`VLMFoundation`'s (checked against the pipeline layout and ``recompute``).
    """
    model_class = partial(VLMFoundation, mrope_section=mrope_section, mrope_interleaved=mrope_interleaved,
                          deepstack_layers=deepstack_layers)
    model = build_gpt_model(cfg, config, capabilities, pre_process, post_process, pg_collection, vp_stage,
                            fused_kernels=fused_kernels, model_class=model_class)
    assert isinstance(model, VLMFoundation)
    return model


__all__ = [
    "VLMFoundation",
    "VisualPositions",
    "build_foundation",
    "check_deepstack",
    "check_mrope",
    "first_stage_layers",
    "mrope_channel_rows",
    "mrope_freqs_from_positions",
]
