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
    config: GrootN17Config

    def __init__(self, config: GrootN17Config) -> None:
        super().__init__(config)
        self.backbone = build_backbone(config)
        self.action_head = GrootActionHead(config.action_head_config())
        self.image_token_id = int(self.backbone.config.image_token_id)
        self.video_token_id = int(self.backbone.config.video_token_id)
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
    def vl_features(self, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(features [b, s, hidden], valid-token mask [b, s], image-token mask [b, s])`` of the backbone.

        ``Qwen3VLModel.forward`` written out over its own pieces, for one reason: GR00T reads the last kept
        decoder layer's output as that layer returns it, before the final norm *and* before any deepstack
        injection after it (lerobot captures it with a forward hook on that layer).
        """

        missing = [k for k in BACKBONE_KEYS[:4] if k not in inputs]
        if missing:
            raise LoongError(f"groot_n1_7 inputs: missing {', '.join(missing)} (made by GrootN17Processor)")
        input_ids, attention_mask, grid = inputs["input_ids"], inputs["attention_mask"], inputs["image_grid_thw"]
        mm_types = inputs.get("mm_token_type_ids")
        if mm_types is None:
            mm_types = ((input_ids == self.image_token_id).int() + 2 * (input_ids == self.video_token_id).int())
        lm, visual = self.backbone.language_model, self.backbone.visual
        embeds = lm.embed_tokens(input_ids)
        vision = visual(inputs["pixel_values"].type(visual.dtype), grid_thw=grid, return_dict=True)
        image_mask = input_ids == self.image_token_id
        n_tokens, n_features = int(image_mask.sum()), vision.pooler_output.shape[0]
        if n_tokens != n_features:
            raise LoongError(f"groot_n1_7 inputs: {n_tokens} image tokens in input_ids but {n_features} image "
                             "features from pixel_values / image_grid_thw")
        embeds = embeds.masked_scatter(image_mask.unsqueeze(-1), vision.pooler_output.to(embeds.dtype))
        deepstack = vision.deepstack_features or []
        # 3-row M-RoPE ids; the causal mask is built from the temporal row as text positions (lerobot's 4-row ids)
        positions = self.backbone.compute_3d_position_ids(
            input_ids=input_ids, inputs_embeds=None, image_grid_thw=grid, attention_mask=attention_mask,
            mm_token_type_ids=mm_types)
        text_positions = positions[0]
        mask = causal_padding_mask(attention_mask, embeds.dtype)
        rope = lm.rotary_emb(embeds, positions)
        hidden = embeds
        last = len(lm.layers) - 1
        for i, layer in enumerate(lm.layers):
            hidden = layer(hidden, attention_mask=mask, position_ids=text_positions, position_embeddings=rope)
            if i < len(deepstack) and i < last:
                hidden = hidden.clone()
                hidden[image_mask] = hidden[image_mask] + deepstack[i].to(hidden.dtype)
        return hidden, attention_mask == 1, image_mask

    def _embodiment(self, inputs: Mapping[str, torch.Tensor], batch: int, device: torch.device) -> torch.Tensor:
        emb = inputs.get("embodiment_id")
        if emb is None:
            return torch.full((batch,), self.config.embodiment_id, dtype=torch.long, device=device)
        if int(emb.max()) >= self.config.num_embodiments or int(emb.min()) < 0:
            raise LoongError(f"groot_n1_7 inputs: embodiment_id must be in [0, {self.config.num_embodiments}), "
                             f"got {emb.tolist()}")
        return emb.long()

    def loss(self, inputs: Mapping[str, torch.Tensor], *, noise: torch.Tensor | None = None,
             time: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """GR00T's masked flow-matching loss. ``time`` ``[b]`` is GR00T's t (0 = noise, 1 = clean)."""
        for key in ("state", "action", "action_mask"):
            if key not in inputs:
                raise LoongError(f"groot_n1_7 inputs: missing {key!r} (made by GrootN17Processor with train=True)")
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
