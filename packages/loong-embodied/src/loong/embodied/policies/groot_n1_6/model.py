"""The GR00T N1.6 policy: Eagle 3 VL backbone -> GR00T flow-matching action head.

Isaac-GR00T ``Gr00tN1d6`` = ``backbone`` (:class:`~.eagle.EagleBackbone`) + ``action_head`` (the shared
:class:`~loong.embodied.policies.groot.GrootActionHead` configured as N1.6: alternate-VL DiT, no VL self-attention,
the ``mask_token`` state dropout when ``state_dropout_prob > 0``). The module names are the published checkpoint's
top-level prefixes, and the head's ``state_dict`` keys are the published ``action_head.*`` keys as they are.

Model inputs (what :class:`~.processor.GrootN16Processor` makes)::

    input_ids, attention_mask   [b, s]                 prompt with <IMG_CONTEXT> runs, left-padded
    pixel_values                [b, cameras, 3, H, W]  in [-1, 1]
    state                       [b, max_state_dim]     min-max normalised, zero-padded
    action, action_mask         [b, chunk, max_action_dim]   (training only)
    embodiment_id               [b] long
    image_token_index           [b * cameras * tokens] long  flat positions of the image tokens (:mod:`.precompute`)
    vision_pos_weights          [patches, num_patches] fp32  the position table's resize to the image grid

The training step is capture-safe (``cuda_graph_safe``): with the two precomputed tensors the backbone neither
reads from the device nor copies host data to it (:mod:`.eagle`), and :meth:`GrootN16Policy.host_draws` draws the
Beta flow times on the host before the step.

N1.6 head details the shared head does not have: Isaac-GR00T's ``state_additive_noise_scale`` (default 0, a
no-op at the published setting) and real-time chunking at inference (``get_action`` with a previous chunk); both
are left out.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from loong.core.errors import LoongError
from loong.embodied.policies.base import VLAPolicy
from loong.embodied.policies.groot import ActionHeadConfig, DiTConfig, GrootActionHead, SelfAttentionConfig
from loong.embodied.policies.groot.flow import host_times, with_host_times
from loong.embodied.policies.groot_n1_6 import precompute as pre
from loong.embodied.policies.groot_n1_6.config import GrootN16Config
from loong.embodied.policies.groot_n1_6.eagle import EagleBackbone

#: the model-input keys :meth:`GrootN16Policy.loss` reads (``predict_action_chunk``: all but the action ones)
INPUT_KEYS = ("input_ids", "attention_mask", "pixel_values", "state", "embodiment_id", "action", "action_mask")


def action_head_config(config: GrootN16Config) -> ActionHeadConfig:
    """The shared head's config for N1.6 (Isaac-GR00T ``Gr00tN1d6ActionHead``)."""
    return ActionHeadConfig(
        max_state_dim=config.max_state_dim, max_action_dim=config.max_action_dim, action_horizon=config.chunk_size,
        state_history_length=1, hidden_size=config.hidden_size, input_embedding_dim=config.input_embedding_dim,
        backbone_embedding_dim=config.backbone_embedding_dim, num_embodiments=config.num_embodiments,
        add_pos_embed=config.add_pos_embed, max_seq_len=config.max_seq_len, use_vlln=config.use_vlln,
        state_dropout_prob=config.state_dropout_prob,
        # N1.6 replaces a dropped state by a learned token, which exists only when dropout is on
        use_state_mask_token=config.state_dropout_prob > 0,
        dit=DiTConfig(num_layers=config.dit_num_layers, num_attention_heads=config.dit_num_heads,
                      attention_head_dim=config.dit_head_dim, output_dim=config.hidden_size,
                      cross_attention_dim=config.backbone_embedding_dim, dropout=config.dit_dropout,
                      final_dropout=True, interleave_self_attention=True, use_alternate_vl_dit=True,
                      attend_text_every_n_blocks=config.attend_text_every_n_blocks),
        vl_self_attention=SelfAttentionConfig(num_layers=0),  # N1.6 has none: vlln only
        num_inference_steps=config.num_inference_steps, noise_beta_alpha=config.noise_beta_alpha,
        noise_beta_beta=config.noise_beta_beta, noise_s=config.noise_s,
        num_timestep_buckets=config.num_timestep_buckets)


class GrootN16Policy(VLAPolicy):
    """GR00T N1.6 (see the module docstring). Random init, fp32; frozen parts per the config's ``tune_*``."""

    name = "groot_n1_6"
    cuda_graph_safe = True

    def __init__(self, config: GrootN16Config) -> None:
        super().__init__(config)
        self.config: GrootN16Config = config
        self.backbone = EagleBackbone(config)
        self.action_head = GrootActionHead(action_head_config(config))
        self.action_head.set_trainable(tune_projector=config.tune_projector,
                                       tune_diffusion_model=config.tune_diffusion_model, tune_vlln=config.tune_vlln)

    def blocks(self) -> list[nn.Module]:
        return [*self.backbone.blocks(), *self.action_head.blocks()]

    def _vl(self, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        for key in INPUT_KEYS[:5]:
            if key not in inputs:
                raise LoongError(f"groot_n1_6: model inputs lack {key!r}; they have: {', '.join(inputs)}")
        input_ids = inputs["input_ids"]
        vl_mask = inputs["attention_mask"].to(torch.bool)
        # the processor's precomputed tensors when it made them; else the backbone computes them (device reads)
        tokens = self.backbone(input_ids, inputs["attention_mask"], inputs["pixel_values"],
                               image_token_index=inputs.get(pre.IMAGE_INDEX_KEY),
                               pos_weights=inputs.get(pre.POS_WEIGHT_KEY))
        return tokens, vl_mask, input_ids == self.config.image_token_id

    def host_draws(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``inputs`` with the Beta flow times drawn on the host (:func:`~loong.embodied.policies.groot.flow.
        with_host_times`), which :meth:`loss` then takes."""
        return with_host_times(inputs, self.action_head.sample_time, "groot_n1_6")

    def loss(self, inputs: Mapping[str, torch.Tensor], *, noise: torch.Tensor | None = None,
             time: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """GR00T's masked flow-matching loss. ``time`` ``[b]``: GR00T's t (0 = noise, 1 = clean); None: the times
        :meth:`host_draws` put in ``inputs[FLOW_TIME_KEY]``, else drawn by the head after its noise draw."""
        for key in ("action", "action_mask"):
            if key not in inputs:
                raise LoongError(f"groot_n1_6.loss: model inputs lack {key!r} (made by the processor with train=True)")
        if time is None:
            time = host_times(inputs, "groot_n1_6")
        tokens, vl_mask, image_mask = self._vl(inputs)
        # the robot side arrives in fp32 (the task does not cast inputs); the head computes in the backbone's dtype
        dtype = tokens.dtype
        loss, metrics = self.action_head.loss(tokens, inputs["state"].to(dtype), inputs["action"].to(dtype),
                                              inputs["action_mask"],
                                              inputs["embodiment_id"], vl_mask=vl_mask, image_mask=image_mask,
                                              noise=noise, time=time)
        return loss, {"loss": loss.detach(), **{k: v for k, v in metrics.items() if v.dim() == 0}}

    @torch.no_grad()
    def predict_action_chunk(self, inputs: Mapping[str, torch.Tensor], *,
                             noise: torch.Tensor | None = None) -> torch.Tensor:
        tokens, vl_mask, image_mask = self._vl(inputs)
        return self.action_head.sample(tokens, inputs["state"].to(tokens.dtype), inputs["embodiment_id"],
                                       vl_mask=vl_mask,
                                       image_mask=image_mask, noise=noise,
                                       num_steps=self.config.num_inference_steps)


__all__ = ["INPUT_KEYS", "GrootN16Policy", "action_head_config"]
