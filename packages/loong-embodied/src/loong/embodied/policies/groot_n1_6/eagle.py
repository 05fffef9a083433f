"""GR00T N1.6's Eagle 3 VL backbone: SigLIP2 -> pixel shuffle -> MLP connector -> Qwen3 cut at ``select_layer``.

What Isaac-GR00T builds (``gr00t/model/modules/eagle_backbone.py`` + ``Eagle-Block2A-2B-v2/modeling_eagle3_vl.py``),
with the pieces taken from ``transformers`` as they are::

    pixels [n, 3, H, W] in [-1, 1]
      -> patches [n, (H/p)(W/p), p*p*3]      (row-major patches, (dy, dx, channel) inside each: SigLIP2's order)
      -> Siglip2VisionModel                   last_hidden_state (post-LayerNorm), one image per row, no padding
      -> pixel shuffle [n, (H/2p)(W/2p), 4C]  F.pixel_unshuffle(factor 2) of the [C, H/p, W/p] grid
      -> mlp1                                 LayerNorm(4C) -> Linear(4C, D) -> GELU -> Linear(D, D)
      -> scattered into the token embeddings where input_ids == image_token_id (camera order, then token order)
      -> Qwen3Model with select_layer layers  last_hidden_state (its final RMSNorm applied, as GR00T's
                                             hidden_states[-1] is once the upper layers are popped)

The published vision config has ``use_rope=false`` and ``use_windows_attn=false``: Eagle's SigLIP2 fork then
attends over each image's patches in full with the learned (bilinearly resized) position embeddings, which is
exactly transformers' ``Siglip2VisionModel`` on an unpadded image. The pooling head the published checkpoint
carries is unused by GR00T and is not built here (:mod:`.checkpoint` skips its weights).

Freezing is ``requires_grad`` only (GR00T's ``set_trainable_parameters``): ``tune_llm=False`` freezes the language
model (embeddings, layers, final norm) and then re-enables its top ``tune_top_llm_layers`` layers;
``tune_visual=False`` freezes the vision tower and ``mlp1``. Neither tower has dropout, so GR00T's
"frozen modules in eval mode" changes nothing and is not repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config, Qwen3Model, Siglip2VisionConfig, Siglip2VisionModel

from loong.core.errors import LoongError
from loong.embodied.policies.groot_n1_6.config import GrootN16Config


def vision_config(config: GrootN16Config) -> Siglip2VisionConfig:
    """transformers' config of the SigLIP2 tower (no pooling head)."""
    vc = Siglip2VisionConfig(
        hidden_size=config.vision_hidden_size, intermediate_size=config.vision_intermediate_size,
        num_hidden_layers=config.vision_num_layers, num_attention_heads=config.vision_num_heads,
        num_channels=3, patch_size=config.patch_size, hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=config.vision_layer_norm_eps, attention_dropout=0.0, vision_use_head=False,
        num_patches=config.vision_num_patches)
    vc._attn_implementation = "sdpa"
    return vc


def text_config(config: GrootN16Config) -> Qwen3Config:
    """transformers' config of the Qwen3 language model, already cut to ``select_layer`` layers."""
    tc = Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.text_hidden_size,
        intermediate_size=config.text_intermediate_size, num_hidden_layers=config.select_layer,
        num_attention_heads=config.text_num_heads, num_key_value_heads=config.text_num_kv_heads,
        head_dim=config.text_head_dim, hidden_act="silu", max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        attention_bias=False, attention_dropout=0.0, use_cache=False, tie_word_embeddings=False)
    tc._attn_implementation = "sdpa"
    return tc


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[n, c, H, W]`` -> ``[n, (H/p)(W/p), p*p*c]``: row-major patches, each flattened as (dy, dx, channel)
    (SigLIP2's processor order, which Eagle's ``convert_images_to_patches`` shares)."""
    n, c, h, w = images.shape
    gh, gw = h // patch_size, w // patch_size
    x = images.reshape(n, c, gh, patch_size, gw, patch_size).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(n, gh * gw, patch_size * patch_size * c)


def pixel_shuffle(features: torch.Tensor, grid: tuple[int, int], factor: int) -> torch.Tensor:
    """``[n, gh*gw, C]`` -> ``[n, (gh/f)(gw/f), C*f*f]``: Eagle's ``pixel_shuffle_back`` (``F.pixel_unshuffle`` on the
    channel-first grid, channel index ``c * f * f + dy * f + dx``)."""
    n, _, c = features.shape
    gh, gw = grid
    x = features.transpose(1, 2).reshape(n, c, gh, gw)
    x = F.pixel_unshuffle(x, factor)
    return x.flatten(2).transpose(1, 2)


class EagleBackbone(nn.Module):
    """Images + prompt tokens -> VL tokens ``[b, s, text_hidden_size]`` (see the module docstring)."""

    def __init__(self, config: GrootN16Config) -> None:
        super().__init__()
        self.config = config
        self.vision_model = Siglip2VisionModel(vision_config(config))
        shuffled = config.vision_hidden_size * config.pixel_shuffle ** 2
        self.mlp1 = nn.Sequential(nn.LayerNorm(shuffled), nn.Linear(shuffled, config.text_hidden_size), nn.GELU(),
                                  nn.Linear(config.text_hidden_size, config.text_hidden_size))
        self.language_model = Qwen3Model(text_config(config))
        self.set_trainable(tune_llm=config.tune_llm, tune_visual=config.tune_visual,
                           tune_top_llm_layers=config.tune_top_llm_layers)

    def set_trainable(self, *, tune_llm: bool, tune_visual: bool, tune_top_llm_layers: int) -> None:
        """GR00T's ``set_trainable_parameters``: freeze by flag, then unfreeze the top LM layers."""
        self.requires_grad_(True)
        if not tune_llm:
            self.language_model.requires_grad_(False)
        if not tune_visual:
            self.vision_model.requires_grad_(False)
            self.mlp1.requires_grad_(False)
        if tune_top_llm_layers > 0:
            for layer in self.language_model.layers[-tune_top_llm_layers:]:
                layer.requires_grad_(True)

    def blocks(self) -> list[nn.Module]:
        """The SigLIP2 encoder layers then the Qwen3 decoder layers."""
        return [*self.vision_model.encoder.layers, *self.language_model.layers]

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[n, 3, H, W]`` (normalised to [-1, 1]) -> ``[n, tokens_per_image, text_hidden_size]``."""
        c = self.config
        n, _, h, w = pixel_values.shape
        grid = (h // c.patch_size, w // c.patch_size)
        patches = patchify(pixel_values, c.patch_size).to(self.vision_model.embeddings.patch_embedding.weight.dtype)
        spatial_shapes = torch.tensor([grid] * n, dtype=torch.long, device=pixel_values.device)
        # every image fills its row: the mask is all ones (full attention within the image, as Eagle's packing)
        mask = torch.ones(patches.shape[:2], dtype=torch.long, device=pixel_values.device)
        hidden = self.vision_model(pixel_values=patches, pixel_attention_mask=mask,
                                   spatial_shapes=spatial_shapes).last_hidden_state
        return self.mlp1(pixel_shuffle(hidden, grid, c.pixel_shuffle))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                pixel_values: torch.Tensor) -> torch.Tensor:
        """``input_ids`` / ``attention_mask`` ``[b, s]``, ``pixel_values`` ``[b, cameras, 3, H, W]`` ->
        ``[b, s, text_hidden_size]``. Each sample's image tokens take its cameras' features in order."""
        b, cams = pixel_values.shape[:2]
        vit = self.image_features(pixel_values.flatten(0, 1))  # [b * cams, tokens, d]
        embeds = self.language_model.embed_tokens(input_ids)
        is_image = input_ids == self.config.image_token_id
        expected = cams * vit.shape[1]
        counts = is_image.sum(dim=1)
        if bool((counts != expected).any()):
            raise LoongError(f"groot_n1_6: input_ids has {counts.tolist()} image tokens per sample; {cams} cameras of "
                             f"{vit.shape[1]} tokens need {expected} each (prompt and image_size disagree)")
        # row-major boolean indexing visits sample 0's tokens first, in order: the same order as vit's rows
        embeds = embeds.masked_scatter(is_image[..., None], vit.reshape(b * expected, -1).to(embeds.dtype))
        return self.language_model(inputs_embeds=embeds, attention_mask=attention_mask,
                                   use_cache=False).last_hidden_state


__all__ = ["EagleBackbone", "patchify", "pixel_shuffle", "text_config", "vision_config"]
