"""GR00T N1.7: transformers' ``Qwen3VLModel`` truncated after ``select_layer`` decoder layers + the GR00T head.

What lerobot 0.6.1's ``GR00TN17`` computes, written as one module:

- The backbone is ``Qwen3VLModel`` as transformers ships it (vision tower with deepstack, M-RoPE text model),
  its decoder cut to the first ``select_layer`` layers. GR00T reads the *last kept decoder layer's output* as
  the layer returns it: before the text model's final RMSNorm (kept, unused: its weight is in the checkpoints)
  and before a deepstack injection after that layer, so :meth:`GrootN17Policy.vl_features` runs the pieces.
- Position ids: the 3-row M-RoPE ids, the temporal row doubling as text positions (lerobot's "legacy" 4-row
  ids), so the causal mask is built from the same positions as lerobot's.
- The head (:class:`~loong.embodied.policies.groot.GrootActionHead`) cross-attends to those features, text and
  image tokens alternately.

The training step is capture-safe (``cuda_graph_safe``): the index tensors Qwen3-VL derives from ``input_ids`` and
``image_grid_thw`` with host reads (M-RoPE ids, the vision tower's rotary ids, pos-embed taps and image boundaries,
the image tokens' positions) come precomputed from the processor (:mod:`.precompute`) and go into transformers'
vision tower through the ``kwargs`` it takes them by; image features and deepstack are placed by index
(``index_copy`` / ``index_add``), not by boolean masks; the Beta flow times are drawn on the host by
:meth:`GrootN17Policy.host_draws`. Inputs without the precomputed keys (direct callers) get them computed here by
the same functions, with device reads.

Parameter names: ``backbone.visual.*``, ``backbone.language_model.*`` (transformers' own), ``action_head.*``
(the published GR00T names); :mod:`.lerobot` maps them to lerobot's ``GrootPolicy``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from loong.core.errors import LoongError
from loong.embodied.policies.base import VLAPolicy
from loong.embodied.policies.groot import GrootActionHead
from loong.embodied.policies.groot.embodiment import check_embodiment_ids
from loong.embodied.policies.groot.flow import host_times, with_host_times
from loong.embodied.policies.groot_n1_7 import precompute as pre
from loong.embodied.policies.groot_n1_7.config import GrootN17Config
from loong.embodied.policies.groot_n1_7.vision_attention import use_image_batched_attention

#: the model-input keys the backbone reads (processor output)
BACKBONE_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def build_backbone(config: GrootN17Config) -> nn.Module:
    """``Qwen3VLModel`` from ``config.backbone``, decoder truncated to ``select_layer`` layers."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    qwen_config = Qwen3VLConfig(**config.backbone_dict())
    n_layers = qwen_config.text_config.num_hidden_layers
    if not 0 < config.select_layer <= n_layers:
        raise LoongError(f"groot_n1_7.select_layer: {config.select_layer} not in 1..{n_layers} (the backbone's "
                         "decoder layers)")
    backbone = Qwen3VLModel(qwen_config)
    lm = backbone.language_model
    lm.layers = nn.ModuleList(list(lm.layers)[: config.select_layer])
    # all the images of a batch in one attention call per layer, not one call per image (vision_attention.py)
    use_image_batched_attention(backbone.visual)
    return backbone


def causal_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``[b, 1, s, s]`` mask of causal attention over the non-padding keys (0 allowed, the dtype's
    minimum masked), the form every transformers attention implementation takes. Built here rather than by
    ``transformers.masking_utils.create_causal_mask``, whose keyword arguments changed between 5.17 and 5.24."""
    s = attention_mask.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None, None] & attention_mask.bool()[:, None, None, :]
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                      torch.finfo(dtype).min)


class GrootN17Policy(VLAPolicy):
    """GR00T N1.7 (Cosmos-Reason2 / Qwen3-VL backbone, 4-layer VL self-attention, 32-layer alternate-VL DiT)."""

    name = "groot_n1_7"
    cuda_graph_safe = True
    config: GrootN17Config

    def __init__(self, config: GrootN17Config) -> None:
        super().__init__(config)
        self.backbone = build_backbone(config)
        self.action_head = GrootActionHead(config.action_head_config())
        self.geometry = pre.BackboneGeometry.of(self.backbone.config)
        self.image_token_id = self.geometry.image_token_id
        self.video_token_id = self.geometry.video_token_id
        self.set_trainable()

    # --- the pretrained backbone (model.config.base_model_path) ---
    @classmethod
    def check_base_model(cls, config: GrootN17Config) -> None:
        """Refuse, before anything is written, a ``base_model_path`` folder whose tensors do not fit the backbone
        (a backbone on the meta device against the safetensors headers; nothing is allocated or read)."""
        if config.base_model_path is None:
            return
        from loong.embodied.policies.groot_n1_7.backbone_init import check_backbone_fits

        with torch.device("meta"):
            backbone = build_backbone(config)
        shapes = {k: tuple(v.shape) for k, v in backbone.state_dict().items()}
        check_backbone_fits(shapes, config.base_model_path, config.select_layer)

    def load_base_model(self) -> None:
        """The backbone's weights from ``config.base_model_path`` (a fresh run's start; no-op when unset)."""
        if self.config.base_model_path is None:
            return
        from loong.embodied.policies.groot_n1_7.backbone_init import load_backbone

        load_backbone(self.backbone, self.config.base_model_path, self.config.select_layer)

    # --- freezing (GR00T's flags; frozen parts get requires_grad=False and stay in eval mode) ---
    def frozen_modules(self) -> list[nn.Module]:
        """The submodules the config freezes (kept in eval mode while training, as GR00T does)."""
        c, head = self.config, self.action_head
        frozen: list[nn.Module] = []
        if not c.tune_llm:
            frozen.append(self.backbone.language_model)
        if not c.tune_visual:
            frozen.append(self.backbone.visual)
        if not c.tune_projector:
            frozen += head.projector_modules()
        if not c.tune_diffusion_model:
            frozen.append(head.model)
        if not c.tune_vlln:
            frozen += [head.vlln, head.vl_self_attention]
        return frozen

    def set_trainable(self) -> None:
        c = self.config
        self.backbone.requires_grad_(True)
        if not c.tune_llm:
            self.backbone.language_model.requires_grad_(False)
        if not c.tune_visual:
            self.backbone.visual.requires_grad_(False)
        if c.tune_top_llm_layers > 0:
            for layer in self.backbone.language_model.layers[-c.tune_top_llm_layers:]:
                layer.requires_grad_(True)
        self.action_head.set_trainable(tune_projector=c.tune_projector,
                                       tune_diffusion_model=c.tune_diffusion_model, tune_vlln=c.tune_vlln)
        for module in self.unused_modules():
            module.requires_grad_(False)

    def unused_modules(self) -> list[nn.Module]:
        """Backbone parts the truncated decoder never reaches, whatever the flags: the text model's final norm
        (GR00T reads the last kept layer's output before it) and the deepstack mergers whose target layer is the
        last kept one or beyond (:meth:`vl_features` adds deepstack only before the last layer). Trainable, they
        would get no gradient: DDP stops at the first step on parameters without gradients, and the optimiser
        would hold state for them."""
        mergers = list(self.backbone.visual.deepstack_merger_list)
        return [self.backbone.language_model.norm, *mergers[max(len(self.backbone.language_model.layers) - 1, 0):]]

    def train(self, mode: bool = True) -> GrootN17Policy:
        super().train(mode)
        if mode:
            for module in self.frozen_modules():
                module.eval()
            if self.config.tune_top_llm_layers > 0 and not self.config.tune_llm:
                for layer in self.backbone.language_model.layers[-self.config.tune_top_llm_layers:]:
                    layer.train()
        return self

    def blocks(self) -> list[nn.Module]:
        """The kept text decoder layers, then the DiT blocks."""
        return list(self.backbone.language_model.layers) + self.action_head.blocks()

    # --- forward ---
    def backbone_indices(self, inputs: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """The :data:`~.precompute.PRECOMPUTED_KEYS` tensors and the longest image's patch count (a host int).

        From ``inputs`` when the processor put them there (no device read: the processor checked that the images
        share one size, so the length is the shapes'); else computed by :func:`~.precompute.precompute` from
        ``input_ids`` / ``image_grid_thw`` (read back from the device) and moved to the inputs' device.
        """
        missing = [k for k in BACKBONE_KEYS[:4] if k not in inputs]
        if missing:
            raise LoongError(f"groot_n1_7 inputs: missing {', '.join(missing)} (made by GrootN17Processor)")
        grid, pixels = inputs["image_grid_thw"], inputs["pixel_values"]
        if all(k in inputs for k in pre.PRECOMPUTED_KEYS):
            return {k: inputs[k] for k in pre.PRECOMPUTED_KEYS}, pre.max_image_patches(pixels, grid)
        device = inputs["input_ids"].device
        found = pre.precompute(inputs["input_ids"], inputs["attention_mask"], inputs.get("mm_token_type_ids"), grid,
                               self.geometry)
        longest = pre.max_image_patches(pixels, grid, found[pre.CU_SEQLENS_KEY])
        return {k: v.to(device) for k, v in found.items()}, longest

    def vl_features(self, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(features [b, s, hidden], valid-token mask [b, s], image-token mask [b, s])`` of the backbone.

        ``Qwen3VLModel.forward`` written out over its own pieces, for one reason: GR00T reads the last kept
        decoder layer's output as that layer returns it, before the final norm *and* before any deepstack
        injection after it (lerobot captures it with a forward hook on that layer). The vision tower is
        transformers' ``Qwen3VLVisionModel.forward`` given the precomputed index tensors; the image features and
        deepstack go to the image tokens by their flat positions (one copy / one addition per element, as
        ``masked_scatter`` and the boolean-mask update transformers uses).
        """
        idx, longest = self.backbone_indices(inputs)
        input_ids, attention_mask, grid = inputs["input_ids"], inputs["attention_mask"], inputs["image_grid_thw"]
        lm, visual = self.backbone.language_model, self.backbone.visual
        embeds = lm.embed_tokens(input_ids)
        vision = visual(inputs["pixel_values"].type(visual.dtype), grid_thw=grid, return_dict=True,
                        cu_seqlens=idx[pre.CU_SEQLENS_KEY], max_seqlen=longest,
                        position_ids=idx[pre.VISION_POSITION_KEY], interp_indices=idx[pre.INTERP_INDEX_KEY],
                        interp_weights=idx[pre.INTERP_WEIGHT_KEY])
        image_index = idx[pre.IMAGE_INDEX_KEY]
        if image_index.shape[0] != vision.pooler_output.shape[0]:  # shapes only: no device read
            raise LoongError(f"groot_n1_7 inputs: {image_index.shape[0]} image tokens in input_ids but "
                             f"{vision.pooler_output.shape[0]} image features from pixel_values / image_grid_thw")
        b, s, width = embeds.shape
        embeds = embeds.reshape(b * s, width).index_copy(0, image_index, vision.pooler_output.to(embeds.dtype))
        embeds = embeds.view(b, s, width)
        image_mask = input_ids == self.image_token_id
        deepstack = vision.deepstack_features or []
        # 3-row M-RoPE ids; the causal mask is built from the temporal row as text positions (lerobot's 4-row ids)
        positions = idx[pre.MROPE_KEY]
        text_positions = positions[0]
        mask = causal_padding_mask(attention_mask, embeds.dtype)
        rope = lm.rotary_emb(embeds, positions)
        hidden = embeds
        last = len(lm.layers) - 1
        for i, layer in enumerate(lm.layers):
            hidden = layer(hidden, attention_mask=mask, position_ids=text_positions, position_embeddings=rope)
            if i < len(deepstack) and i < last:
                flat = hidden.reshape(b * s, hidden.shape[-1])
                hidden = flat.index_add(0, image_index, deepstack[i].to(hidden.dtype)).view(hidden.shape)
        return hidden, attention_mask == 1, image_mask

    def _embodiment(self, inputs: Mapping[str, torch.Tensor], batch: int, device: torch.device) -> torch.Tensor:
        emb = inputs.get("embodiment_id")
        if emb is None:
            return torch.full((batch,), self.config.embodiment_id, dtype=torch.long, device=device)
        if not all(k in inputs for k in pre.PRECOMPUTED_KEYS):  # the processor's inputs: it checked the range
            check_embodiment_ids(emb, self.config.num_embodiments, "groot_n1_7 inputs")
        return emb.long()

    def host_draws(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``inputs`` with the Beta flow times drawn on the host (:func:`~loong.embodied.policies.groot.flow.
        with_host_times`), which :meth:`loss` then takes."""
        return with_host_times(inputs, self.action_head.sample_time, "groot_n1_7")

    def loss(self, inputs: Mapping[str, torch.Tensor], *, noise: torch.Tensor | None = None,
             time: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """GR00T's masked flow-matching loss. ``time`` ``[b]`` is GR00T's t (0 = noise, 1 = clean); None: the times
        :meth:`host_draws` put in ``inputs[FLOW_TIME_KEY]``, else drawn by the head after its dropout and noise
        draws (GR00T's order)."""
        for key in ("state", "action", "action_mask"):
            if key not in inputs:
                raise LoongError(f"groot_n1_7 inputs: missing {key!r} (made by GrootN17Processor with train=True)")
        if time is None:
            time = host_times(inputs, "groot_n1_7")
        feats, vl_mask, image_mask = self.vl_features(inputs)
        dtype = feats.dtype
        emb = self._embodiment(inputs, feats.shape[0], feats.device)
        loss, metrics = self.action_head.loss(
            feats, inputs["state"].to(dtype), inputs["action"].to(dtype), inputs["action_mask"], emb,
            vl_mask=vl_mask, image_mask=image_mask, noise=noise, time=time)
        return loss, {"loss": loss.detach()}

    @torch.no_grad()
    def predict_action_chunk(self, inputs: Mapping[str, torch.Tensor], *,
                             noise: torch.Tensor | None = None) -> torch.Tensor:
        feats, vl_mask, image_mask = self.vl_features(inputs)
        emb = self._embodiment(inputs, feats.shape[0], feats.device)
        return self.action_head.sample(feats, inputs["state"].to(feats.dtype), emb, vl_mask=vl_mask,
                                       image_mask=image_mask, noise=noise)


__all__ = ["GrootN17Policy", "build_backbone"]
