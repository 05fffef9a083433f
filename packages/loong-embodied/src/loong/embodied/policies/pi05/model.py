"""Pi0.5: PaliGemma (SigLIP + Gemma) reads images and the prompt, a Gemma action expert denoises the action chunk.

One batch, training (facts from openpi ``pi0_pytorch.py`` / lerobot 0.6.1 ``modeling_pi05.py``)::

    prefix = [SigLIP tokens of every camera (projected to the VLM width), Gemma embeddings of the prompt * sqrt(w)]
    suffix = action_in_proj(x_t),  x_t = t * noise + (1 - t) * actions,  t ~ Beta(1.5, 1) * 0.999 + 0.001
    cond   = silu(time_mlp_out(silu(time_mlp_in(sinusoid(t)))))        (the expert's adaRMSNorm condition)
    for each depth i: prefix, suffix = JointLayer_i(prefix, suffix)    (one attention over both sequences)
    v_t    = action_out_proj(expert_norm(suffix, cond));  loss = mean over real action dims of (noise - actions - v_t)²

The attention mask is the published prefix-LM one: prefix tokens (images, prompt) attend to every valid prefix
token, action tokens to the whole valid prefix and to each other, and no prefix token to an action token; padding
(masked cameras, prompt padding) is invisible to all. Positions count valid tokens only. At inference the prefix
runs once through the VLM layers (its keys/values cached per layer); each of ``num_inference_steps`` Euler steps
(``t`` from 1 to 0, ``x += dt * v``) runs only the expert layers over that cache.

The training step is capture-safe (``cuda_graph_safe``): the times are Beta draws of the host generator, so
:meth:`Pi05Policy.host_draws` makes them before the step (``inputs[FLOW_TIME_KEY]``); the noise is drawn on the
device; nothing in the forward or backward reads a device value back or copies host data in (the mask, the
positions and the embedding scale are device ops of the shapes and the padding masks).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from loong.core.errors import LoongError
from loong.embodied.policies.base import FLOW_TIME_KEY, VLAPolicy
from loong.embodied.policies.pi05.config import Pi05Config
from loong.embodied.policies.pi05.gemma import AdaRMSNorm, GemmaLayer, GemmaRMSNorm, JointLayer


def sinusoidal_embedding(time: torch.Tensor, dim: int, min_period: float, max_period: float) -> torch.Tensor:
    """openpi's sine-cosine embedding of scalar times ``[b]`` -> ``[b, dim]`` (computed in float64 where the
    device has it, returned in ``time``'s dtype)."""
    dtype = torch.float32 if time.device.type == "mps" else torch.float64
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=dtype, device=time.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (1.0 / period * 2 * math.pi)[None, :] * time[:, None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).to(time.dtype)


def sample_time(batch: int, config: Pi05Config, device: torch.device) -> torch.Tensor:
    """Flow-matching times ``Beta(alpha, beta) * scale + offset`` (drawn on the CPU, as openpi / lerobot; in
    training by :meth:`Pi05Policy.host_draws`, before the device step)."""
    beta = torch.distributions.Beta(torch.tensor(config.time_sampling_beta_alpha, dtype=torch.float32),
                                    torch.tensor(config.time_sampling_beta_beta, dtype=torch.float32))
    t = beta.sample((batch,)) * config.time_sampling_scale + config.time_sampling_offset
    return t.to(device=device, dtype=torch.float32)


def prefix_lm_mask(pad: torch.Tensor, causal_from: torch.Tensor) -> torch.Tensor:
    """big_vision's mask from ``pad [b, n]`` (True = a real token) and ``causal_from [n]`` (1 where a new block
    starts): token i sees token j when j is real, i is real and j's block is not after i's. A padding token's row
    also sees itself, so no row is empty (its output is never read; an empty row would make NaNs)."""
    blocks = torch.cumsum(causal_from, dim=0)
    allowed = (blocks[None, :] <= blocks[:, None])[None] & pad[:, None, :] & pad[:, :, None]
    return allowed | torch.eye(pad.shape[1], dtype=torch.bool, device=pad.device)[None]


class Pi05Policy(VLAPolicy):
    """The Pi0.5 policy (see the module docstring). Inputs are :class:`~loong.embodied.policies.pi05.processor.
    Pi05Processor`'s: ``images [b, n_cam, 3, H, W]`` in [-1, 1], ``image_masks [b, n_cam]``, ``tokens`` /
    ``token_masks [b, L]``, and for training ``actions [b, chunk, max_action_dim]`` (normalised, zero-padded) with
    ``action_mask [b, max_action_dim]`` (the real action dims)."""

    name = "pi05"
    cuda_graph_safe = True

    def __init__(self, config: Pi05Config) -> None:
        from transformers import SiglipVisionConfig, SiglipVisionModel

        super().__init__(config)
        self.config: Pi05Config = config
        c = config
        vision_config = SiglipVisionConfig(
            hidden_size=c.vision_width, intermediate_size=c.vision_mlp_dim, num_hidden_layers=c.vision_depth,
            num_attention_heads=c.vision_num_heads, image_size=c.image_size, patch_size=c.patch_size,
            hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False)
        vision_config._attn_implementation = "sdpa"
        self.vision_tower = SiglipVisionModel(vision_config)
        self.projector = nn.Linear(c.vision_width, c.vlm_width)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.vlm_width)
        self.layers = nn.ModuleList(
            JointLayer(GemmaLayer(c.vlm_width, c.vlm_mlp_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps),
                       GemmaLayer(c.expert_width, c.expert_mlp_dim, c.num_heads, c.num_kv_heads, c.head_dim,
                                  c.rms_norm_eps, cond_dim=c.expert_width),
                       c.rope_theta, last=i == c.vlm_depth - 1)
            for i in range(c.vlm_depth))
        self.vlm_norm = GemmaRMSNorm(c.vlm_width, c.rms_norm_eps)
        self.expert_norm = AdaRMSNorm(c.expert_width, c.expert_width, c.rms_norm_eps)
        self.action_in_proj = nn.Linear(c.max_action_dim, c.expert_width)
        self.action_out_proj = nn.Linear(c.expert_width, c.max_action_dim)
        self.time_mlp_in = nn.Linear(c.expert_width, c.expert_width)
        self.time_mlp_out = nn.Linear(c.expert_width, c.expert_width)
        self._freeze()

    # parameters ----------------------------------------------------------------------------------------------
    def language_model_parameters(self) -> list[nn.Parameter]:
        """The PaliGemma language model's parameters (what ``tune_llm=False`` freezes)."""
        params = [*self.embed_tokens.parameters(), *self.vlm_norm.parameters()]
        for layer in self.layers:
            params.extend(layer.vlm.parameters())
        return params

    def dead_parameters(self) -> list[nn.Parameter]:
        """Parameters no output of Pi0.5 depends on: the VLM's final norm and, in the top layer, the VLM's query
        and output projections, post-attention norm and MLP (the prefix's top-layer output is never read; only
        its keys and values are). They are kept (checkpoints and the lerobot export carry them) but frozen: in
        lerobot they only ever get zero gradients; here they get none, so DDP sees no unused trainable
        parameter and the optimiser keeps no state for them."""
        return [*self.vlm_norm.parameters(), *self.layers[-1].dead_parameters()]

    def _freeze(self) -> None:
        frozen: list[nn.Parameter] = self.dead_parameters()
        if not self.config.tune_visual:
            frozen.extend(self.vision_tower.parameters())
        if not self.config.tune_llm:
            frozen.extend(self.language_model_parameters())
        if not self.config.tune_llm and not self.config.tune_visual:
            frozen.extend(self.projector.parameters())  # all of PaliGemma, as lerobot's train_expert_only
        for p in frozen:
            p.requires_grad_(False)

    def blocks(self) -> list[nn.Module]:
        """SigLIP's encoder layers, then the joint layers (each: the VLM and the expert layer of one depth)."""
        return [*self.vision_tower.encoder.layers, *self.layers]

    # embeddings ----------------------------------------------------------------------------------------------
    def embed_prefix(self, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefix embeddings ``[b, n_cam * n_img + L, vlm_width]``, its padding mask and its block starts."""
        images, image_masks = inputs["images"], inputs["image_masks"].bool()
        tokens, token_masks = inputs["tokens"], inputs["token_masks"].bool()
        b, n_cam = images.shape[:2]
        pixels = images.flatten(0, 1).to(self.projector.weight.dtype)
        features = self.vision_tower(pixel_values=pixels).last_hidden_state
        image_emb = self.projector(features).view(b, n_cam * features.shape[1], -1)
        image_pad = image_masks.repeat_interleave(features.shape[1], dim=1)
        weight = self.embed_tokens.weight
        # Gemma scales its token embeddings by sqrt(width), rounded to the weights' dtype (as transformers does);
        # a device fill, not a tensor of host data
        scale = torch.full((), weight.shape[1] ** 0.5, dtype=weight.dtype, device=weight.device)
        text_emb = self.embed_tokens(tokens) * scale
        emb = torch.cat([image_emb.to(text_emb.dtype), text_emb], dim=1)
        pad = torch.cat([image_pad, token_masks], dim=1)
        return emb, pad, torch.zeros(emb.shape[1], dtype=torch.long, device=emb.device)

    def embed_suffix(self, x_t: torch.Tensor, time: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Action-token embeddings ``[b, chunk, expert_width]`` and the adaRMSNorm condition ``[b, expert_width]``."""
        c = self.config
        t_emb = sinusoidal_embedding(time, c.expert_width, c.min_period, c.max_period)
        cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(t_emb.to(self.time_mlp_in.weight.dtype)))))
        return self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype)), cond

    # training ------------------------------------------------------------------------------------------------
    def velocity(self, inputs: Mapping[str, torch.Tensor], x_t: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """The predicted velocity ``[b, chunk, max_action_dim]`` at ``x_t``, ``time`` (joint forward, no cache)."""
        prefix, prefix_pad, prefix_blocks = self.embed_prefix(inputs)
        suffix, cond = self.embed_suffix(x_t, time)
        chunk = suffix.shape[1]
        suffix_pad = torch.ones(suffix.shape[:2], dtype=torch.bool, device=suffix.device)
        # the actions start a block the prefix cannot see (a 1 at the first action token)
        suffix_blocks = (torch.arange(chunk, device=suffix.device) == 0).long()
        pad = torch.cat([prefix_pad, suffix_pad], dim=1)
        mask = prefix_lm_mask(pad, torch.cat([prefix_blocks, suffix_blocks]))
        position_ids = torch.cumsum(pad, dim=1) - 1
        suffix = suffix.to(prefix.dtype)
        for layer in self.layers:
            prefix, suffix = layer(prefix, suffix, mask, position_ids, cond)
        out, _ = self.expert_norm(suffix, cond)
        return self.action_out_proj(out.to(self.action_out_proj.weight.dtype)).float()

    def _actions(self, inputs: Mapping[str, torch.Tensor], where: str) -> torch.Tensor:
        """``inputs["actions"]`` ``[b, chunk_size, max_action_dim]``, refused (a LoongError) when absent or of
        another shape."""
        if "actions" not in inputs:
            raise LoongError(f"pi05 {where}: the inputs have no 'actions' (the processor makes them when train=True)")
        actions = inputs["actions"]
        if tuple(actions.shape[1:]) != (self.config.chunk_size, self.config.max_action_dim):
            raise LoongError(f"pi05 {where}: actions of shape {list(actions.shape)}; expected [b, "
                             f"{self.config.chunk_size}, {self.config.max_action_dim}] (chunk_size, max_action_dim)")
        return actions

    def host_draws(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``inputs`` with the flow times (``FLOW_TIME_KEY``, ``[b]`` fp32) drawn on the host (:func:`sample_time`:
        Beta draws of the CPU generator), which :meth:`loss` then takes; its noise it draws on the device."""
        out = dict(inputs)
        out[FLOW_TIME_KEY] = sample_time(self._actions(inputs, "host_draws").shape[0], self.config,
                                         torch.device("cpu"))
        return out

    def loss(self, inputs: Mapping[str, torch.Tensor], *, noise: torch.Tensor | None = None,
             time: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The flow-matching loss: MSE between ``noise - actions`` and the velocity, averaged over the batch, the
        chunk and the real action dims (``action_mask``; all dims when absent), as lerobot's ``PI05Policy``
        (which, like openpi, also counts the steps past an episode's end that ``action_is_pad`` marks).

        ``time`` None: the times :meth:`host_draws` put in ``inputs[FLOW_TIME_KEY]``, else drawn here, after the
        noise (lerobot's order)."""
        actions = self._actions(inputs, "loss").float()
        chunk = actions.shape[1]
        if noise is None:
            noise = torch.randn_like(actions)
        if time is None:
            time = inputs.get(FLOW_TIME_KEY)
        if time is None:
            time = sample_time(actions.shape[0], self.config, actions.device)
        if tuple(time.shape) != actions.shape[:1]:
            raise LoongError(f"pi05 loss: flow times ('{FLOW_TIME_KEY}' or time=) of shape {list(time.shape)}; "
                             f"expected [{actions.shape[0]}] (one per sample)")
        t = time.float()[:, None, None]
        x_t = t * noise + (1 - t) * actions
        target = noise - actions
        per_element = (target - self.velocity(inputs, x_t, time.float())).square()
        mask = inputs.get("action_mask")
        if mask is None:
            loss = per_element.mean()
        else:
            mask = mask.to(per_element.dtype)[:, None, :]
            loss = (per_element * mask).sum() / (mask.sum() * chunk)
        return loss, {"loss": loss.detach()}

    # inference -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def predict_action_chunk(self, inputs: Mapping[str, torch.Tensor], *,
                             noise: torch.Tensor | None = None) -> torch.Tensor:
        """``[b, chunk_size, max_action_dim]`` normalised actions: the prefix is encoded once into a per-layer
        key/value cache, then ``num_inference_steps`` Euler steps from ``t = 1`` (noise) to ``t = 0``."""
        c = self.config
        prefix, prefix_pad, prefix_blocks = self.embed_prefix(inputs)
        b, p = prefix_pad.shape
        if noise is None:
            noise = torch.randn(b, c.chunk_size, c.max_action_dim, device=prefix.device, dtype=torch.float32)
        prefix_mask = prefix_lm_mask(prefix_pad, prefix_blocks)
        prefix_positions = torch.cumsum(prefix_pad, dim=1) - 1
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        hidden = prefix
        for layer in self.layers:
            hidden, k, v = layer.prefix(hidden, prefix_mask, prefix_positions)
            cache.append((k, v))
        chunk = c.chunk_size
        # action tokens see the valid prefix and every action token
        suffix_mask = torch.cat([prefix_pad[:, None, :].expand(b, chunk, p),
                                 torch.ones(b, chunk, chunk, dtype=torch.bool, device=prefix.device)], dim=2)
        positions = prefix_pad.sum(dim=1, keepdim=True) + torch.arange(chunk, device=prefix.device)[None]
        dt = -1.0 / c.num_inference_steps
        x_t = noise.float()
        for step in range(c.num_inference_steps):
            time = torch.tensor(1.0 + step * dt, dtype=torch.float32, device=x_t.device).expand(b)
            suffix, cond = self.embed_suffix(x_t, time)
            suffix = suffix.to(prefix.dtype)
            for layer, (k, v) in zip(self.layers, cache, strict=True):
                suffix = layer.suffix(suffix, k, v, suffix_mask, positions, cond)
            out, _ = self.expert_norm(suffix, cond)
            x_t = x_t + dt * self.action_out_proj(out.to(self.action_out_proj.weight.dtype)).float()
        return x_t


__all__ = ["Pi05Policy", "prefix_lm_mask", "sample_time", "sinusoidal_embedding"]
