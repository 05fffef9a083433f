"""The GR00T flow-matching action head (N1.6 and N1.7): VL tokens + state -> action velocity.

Pieces, with the published checkpoints' parameter names (so weights load by the ``action_head.`` prefix)::

    vlln                LayerNorm over the backbone's VL tokens (Identity when use_vlln=False)
    vl_self_attention   SelfAttentionTransformer over the VL tokens (N1.7: 4 layers; absent when 0 layers)
    state_encoder       CategorySpecificMLP: state [b, 1, state_history * max_state_dim] -> [b, 1, inner]
    action_encoder      MultiEmbodimentActionEncoder: (x_t, timestep) -> [b, horizon, inner]
    position_embedding  learned positions added to the action tokens (add_pos_embed)
    mask_token          N1.6 only (use_state_mask_token): what a dropped state is replaced by
    model               the DiT over [state token, action tokens], cross-attending to the VL tokens
    action_decoder      CategorySpecificMLP: DiT output -> velocity [b, horizon, max_action_dim]

The backbone is the caller's: it hands :meth:`GrootActionHead.loss` / :meth:`GrootActionHead.sample` its last
hidden states ``vl_tokens`` ``[b, s, backbone_embedding_dim]``, the valid-token mask ``vl_mask`` and the image-token
mask ``image_mask`` (both ``[b, s]`` bool).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from loong.embodied.policies.groot.dit import DiT, DiTConfig, SelfAttentionConfig, SelfAttentionTransformer
from loong.embodied.policies.groot.embodiment import CategorySpecificMLP, MultiEmbodimentActionEncoder
from loong.embodied.policies.groot.flow import (
    discretize_time,
    euler_sample,
    masked_velocity_loss,
    noisy_actions,
    sample_time,
)


@dataclass
class ActionHeadConfig:
    """Everything the action head's shape and flow matching depend on (GR00T N1.7 published values).

    ``hidden_size``: the per-embodiment MLPs' width and the DiT's ``output_dim``; ``input_embedding_dim``: the
    token width inside the DiT (``dit.num_attention_heads * dit.attention_head_dim``); ``backbone_embedding_dim``:
    VL token width (``dit.cross_attention_dim`` and the VL self-attention width).
    """

    max_state_dim: int = 132
    max_action_dim: int = 132
    action_horizon: int = 40
    state_history_length: int = 1
    hidden_size: int = 1024
    input_embedding_dim: int = 1536
    backbone_embedding_dim: int = 2048
    num_embodiments: int = 32
    add_pos_embed: bool = True
    max_seq_len: int = 1024
    use_vlln: bool = True
    state_dropout_prob: float = 0.2
    use_state_mask_token: bool = False
    dit: DiTConfig = field(default_factory=DiTConfig)
    vl_self_attention: SelfAttentionConfig = field(default_factory=SelfAttentionConfig)
    num_inference_steps: int = 4
    noise_beta_alpha: float = 1.5
    noise_beta_beta: float = 1.0
    noise_s: float = 0.999
    num_timestep_buckets: int = 1000


class GrootActionHead(nn.Module):
    """Flow-matching action head over a VL backbone's tokens (see the module docstring for its parts)."""

    def __init__(self, config: ActionHeadConfig) -> None:
        super().__init__()
        self.config = c = config
        self.model = DiT(c.dit)
        self.state_encoder = CategorySpecificMLP(c.num_embodiments, c.max_state_dim * c.state_history_length,
                                                 c.hidden_size, c.input_embedding_dim)
        self.action_encoder = MultiEmbodimentActionEncoder(c.max_action_dim, c.input_embedding_dim,
                                                           c.num_embodiments)
        self.action_decoder = CategorySpecificMLP(c.num_embodiments, c.hidden_size, c.hidden_size,
                                                  c.max_action_dim)
        self.vlln: nn.Module = nn.LayerNorm(c.backbone_embedding_dim) if c.use_vlln else nn.Identity()
        self.vl_self_attention: nn.Module = (SelfAttentionTransformer(c.vl_self_attention)
                                             if c.vl_self_attention.num_layers > 0 else nn.Identity())
        if c.add_pos_embed:
            self.position_embedding = nn.Embedding(c.max_seq_len, c.input_embedding_dim)
            nn.init.normal_(self.position_embedding.weight, mean=0.0, std=0.02)
        if c.use_state_mask_token:
            self.mask_token = nn.Parameter(0.02 * torch.randn(1, 1, c.input_embedding_dim))

    # --- the groups the freezing flags name (GR00T's tune_projector / tune_diffusion_model / tune_vlln) ---
    def projector_modules(self) -> list[nn.Module]:
        """State/action encoders, action decoder, position embedding (``tune_projector``)."""
        mods: list[nn.Module] = [self.state_encoder, self.action_encoder, self.action_decoder]
        if self.config.add_pos_embed:
            mods.append(self.position_embedding)
        return mods

    def set_trainable(self, *, tune_projector: bool = True, tune_diffusion_model: bool = True,
                      tune_vlln: bool = True) -> None:
        """``requires_grad`` per GR00T's flags: projector modules (and the N1.6 mask token), the DiT, and
        the VL LayerNorm + VL self-attention."""
        self.requires_grad_(True)
        if not tune_projector:
            for m in self.projector_modules():
                m.requires_grad_(False)
            if self.config.use_state_mask_token:
                self.mask_token.requires_grad_(False)
        if not tune_diffusion_model:
            self.model.requires_grad_(False)
        if not tune_vlln:
            self.vlln.requires_grad_(False)
            self.vl_self_attention.requires_grad_(False)

    def blocks(self) -> list[nn.Module]:
        """The DiT blocks (FSDP / recompute units)."""
        return list(self.model.transformer_blocks)

    # --- the forward pieces ---
    def encode_vl(self, vl_tokens: torch.Tensor) -> torch.Tensor:
        """``vlln`` then the VL self-attention: the tokens the DiT cross-attends to."""
        return self.vl_self_attention(self.vlln(vl_tokens))

    def encode_state(self, state: torch.Tensor, embodiment_id: torch.Tensor) -> torch.Tensor:
        """State ``[b, max_state_dim]`` or ``[b, state_history, max_state_dim]`` -> one token ``[b, 1, inner]``."""
        state = state.reshape(state.shape[0], 1, -1)
        return self.state_encoder(state, embodiment_id)

    def drop_state(self, state_features: torch.Tensor) -> torch.Tensor:
        """Training-time state dropout: each sample's state token is, with ``state_dropout_prob``, zeroed (N1.7)
        or replaced by ``mask_token`` (N1.6). One ``torch.rand(b)`` draw, before the flow-matching draws."""
        p = self.config.state_dropout_prob
        if not self.training or p <= 0:
            return state_features
        drop = (torch.rand(state_features.shape[0], device=state_features.device) < p)
        drop = drop[:, None, None].to(state_features.dtype)
        if self.config.use_state_mask_token:
            return state_features * (1 - drop) + self.mask_token * drop
        return state_features * (1 - drop)

    def velocity(self, x: torch.Tensor, timesteps: torch.Tensor, state_features: torch.Tensor,
                 vl: torch.Tensor, embodiment_id: torch.Tensor, *, vl_mask: torch.Tensor | None,
                 image_mask: torch.Tensor | None) -> torch.Tensor:
        """Predicted velocity ``[b, horizon, max_action_dim]`` of ``x`` at discretised ``timesteps`` ``[b]``
        (``vl``: the output of :meth:`encode_vl`)."""
        action_features = self.action_encoder(x, timesteps, embodiment_id)
        if self.config.add_pos_embed:
            pos = torch.arange(action_features.shape[1], device=x.device)
            action_features = action_features + self.position_embedding(pos).unsqueeze(0)
        tokens = torch.cat([state_features, action_features], dim=1)
        out = self.model(tokens, vl, timesteps, vl_mask=vl_mask, image_mask=image_mask)
        return self.action_decoder(out, embodiment_id)[:, -x.shape[1]:]

    def loss(self, vl_tokens: torch.Tensor, state: torch.Tensor, actions: torch.Tensor, action_mask: torch.Tensor,
             embodiment_id: torch.Tensor, *, vl_mask: torch.Tensor | None = None,
             image_mask: torch.Tensor | None = None, noise: torch.Tensor | None = None,
             time: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The flow-matching loss of one micro-batch.

        ``vl_tokens`` ``[b, s, backbone_embedding_dim]`` (raw backbone features: vlln / VL self-attention are
        applied here); ``state`` ``[b, (history,) max_state_dim]``; ``actions`` / ``action_mask`` ``[b, horizon,
        max_action_dim]``; ``embodiment_id`` ``[b]`` long. ``noise`` ``[b, horizon, max_action_dim]`` and ``time``
        ``[b]`` (GR00T's t: 1 = clean) fix the draws; when None they are drawn in GR00T's order (state dropout,
        then noise, then time), so a seeded run matches lerobot's. Returns ``(loss, metrics)``.
        """
        vl = self.encode_vl(vl_tokens)
        state_features = self.drop_state(self.encode_state(state, embodiment_id))
        if noise is None:
            noise = torch.randn(actions.shape, device=actions.device, dtype=actions.dtype)
        if time is None:
            time = self.sample_time(actions.shape[0], device=actions.device, dtype=actions.dtype)
        x_t, target = noisy_actions(actions, noise.to(actions.dtype), time.to(actions.dtype))
        timesteps = discretize_time(time.to(actions.dtype), self.config.num_timestep_buckets)
        pred = self.velocity(x_t, timesteps, state_features, vl, embodiment_id, vl_mask=vl_mask,
                             image_mask=image_mask)
        loss, per_element = masked_velocity_loss(pred, target, action_mask.to(pred.dtype))
        return loss, {"action_loss": per_element.detach()}

    def sample_time(self, batch_size: int, *, device: torch.device | str | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[b]`` training flow times from the configured Beta distribution (see :func:`flow.sample_time`)."""
        c = self.config
        return sample_time(batch_size, alpha=c.noise_beta_alpha, beta=c.noise_beta_beta, noise_s=c.noise_s,
                           device=device, dtype=dtype)

    @torch.no_grad()
    def sample(self, vl_tokens: torch.Tensor, state: torch.Tensor, embodiment_id: torch.Tensor, *,
               vl_mask: torch.Tensor | None = None, image_mask: torch.Tensor | None = None,
               noise: torch.Tensor | None = None, num_steps: int | None = None) -> torch.Tensor:
        """``[b, action_horizon, max_action_dim]`` actions (normalised) integrated from ``noise`` (drawn from the
        global generator when None, in the VL tokens' dtype) over ``num_steps`` (default:
        ``config.num_inference_steps``) Euler steps."""
        c = self.config
        vl = self.encode_vl(vl_tokens)
        state_features = self.encode_state(state, embodiment_id)
        if noise is None:
            noise = torch.randn((vl.shape[0], c.action_horizon, c.max_action_dim), dtype=vl.dtype, device=vl.device)

        def velocity_fn(x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
            return self.velocity(x, timesteps, state_features, vl, embodiment_id, vl_mask=vl_mask,
                                 image_mask=image_mask)

        return euler_sample(velocity_fn, noise.to(vl.dtype), num_steps=num_steps or c.num_inference_steps,
                            num_buckets=c.num_timestep_buckets)


__all__ = ["ActionHeadConfig", "GrootActionHead"]
