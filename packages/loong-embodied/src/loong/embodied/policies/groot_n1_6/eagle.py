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

The step is sync-free given the processor's :mod:`.precompute` tensors (``image_token_index``,
``vision_pos_weights``): the SigLIP2 tower runs over its pieces with the position-table resize as a precomputed
matrix, the image features go in by ``index_copy`` at the flat image-token positions, and ``Qwen3Model`` gets its
causal padding mask ready-made. Without them (direct callers) they are computed here, with device reads.

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

from loong.embodied.policies.groot_n1_6 import precompute as pre
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

    def image_features(self, pixel_values: torch.Tensor, pos_weights: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, 3, H, W]`` (normalised to [-1, 1]) -> ``[n, tokens_per_image, text_hidden_size]``.

        ``Siglip2VisionModel.forward`` over its own pieces, for the one input it would otherwise derive with host
        data and device reads: the position table's resize to the image grid, here ``pos_weights``
        (:data:`~.precompute.POS_WEIGHT_KEY`, from the processor; None: computed here on the host and copied
        over). The encoder gets no mask: every image fills its row, and transformers drops an all-ones mask for
        SDPA too (full attention within the image, as Eagle's packing)."""
        c = self.config
        n, _, h, w = pixel_values.shape
        grid = pre.patch_grid((h, w), c.patch_size)
        vm = self.vision_model
        emb = vm.embeddings
        if pos_weights is None:
            pos_weights = pre.position_resize_weights(grid, c.vision_num_patches).to(pixel_values.device)
        patches = patchify(pixel_values, c.patch_size).to(emb.patch_embedding.weight.dtype)
        pre.check_pos_weights(pos_weights, patches.shape[1], c.vision_num_patches)
        hidden = emb.patch_embedding(patches) + pre.resized_positions(emb.position_embedding.weight, pos_weights, n)
        hidden = vm.post_layernorm(vm.encoder(inputs_embeds=hidden, attention_mask=None).last_hidden_state)
        return self.mlp1(pixel_shuffle(hidden, grid, c.pixel_shuffle))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_values: torch.Tensor, *,
                image_token_index: torch.Tensor | None = None,
                pos_weights: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` / ``attention_mask`` ``[b, s]``, ``pixel_values`` ``[b, cameras, 3, H, W]`` ->
        ``[b, s, text_hidden_size]``. Each sample's image tokens take its cameras' features in order.

        ``image_token_index`` / ``pos_weights``: the processor's :mod:`.precompute` tensors (then the step reads
        nothing back from the device and copies nothing to it); None: computed here from ``input_ids`` (a device
        read) and the image size, as direct callers need."""
        b, cams = pixel_values.shape[:2]
        vit = self.image_features(pixel_values.flatten(0, 1), pos_weights)  # [b * cams, tokens, d]
        embeds = self.language_model.embed_tokens(input_ids)
        expected = cams * vit.shape[1]
        if image_token_index is None:
            image_token_index = pre.image_token_index(input_ids, self.config.image_token_id, expected,
                                                      where="groot_n1_6").to(input_ids.device)
        pre.check_image_index(image_token_index, b * expected)
        # the features go to the image tokens by their flat positions: one copy per element, as masked_scatter,
        # whose backward would read the mask's count back
        s, width = embeds.shape[1:]
        embeds = embeds.reshape(b * s, width).index_copy(0, image_token_index,
                                                         vit.reshape(b * expected, -1).to(embeds.dtype))
        # Qwen3Model takes a prepared mask as {layer type: mask} and then skips its own, which reads the padding
        # mask back to decide whether SDPA may run is_causal (the tower is built with SDPA: text_config)
        mask = {"full_attention": pre.causal_padding_mask(attention_mask)}
        return self.language_model(inputs_embeds=embeds.view(b, s, width), attention_mask=mask,
                                   use_cache=False).last_hidden_state


__all__ = ["EagleBackbone", "patchify", "pixel_shuffle", "text_config", "vision_config"]
