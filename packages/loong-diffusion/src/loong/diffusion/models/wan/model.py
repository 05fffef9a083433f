"""The Wan 2.1 / 2.2 video transformer (T2V, I2V, TI2V; one expert of an A14B pair), plain PyTorch.

A latent ``[b, in_channels, frames, height, width]`` is cut into ``patch_size`` patches, one token each (frames
outermost, columns innermost); the tokens run through the blocks, conditioned on the timestep (``[b]``, or
``[b, tokens]`` for Wan 2.2 TI2V), the text features and, for Wan 2.1 I2V, CLIP image features; a modulated head
projects every token back to a patch of the ``out_channels`` prediction.

Context parallelism: the model is built with a :class:`~loong.core.attention.CPGroups` (default: none). Each CP
rank embeds only its contiguous shard of the tokens, rotates them by their global grid positions, attends through
``cp_attention`` (self-attention over the whole sharded sequence, cross-attention to the text and image tokens that
every rank holds whole) and predicts its shard's tokens (:meth:`WanTransformer.forward_shard`, for a sharded loss
against :meth:`WanTransformer.patchify` of the target); :meth:`WanTransformer.forward` gathers them into the whole
prediction. The token count must divide by the CP size.

Packing: :meth:`WanTransformer.forward_packed` predicts several clips of different sizes held in one sequence
(:mod:`.packed` builds it): each clip with its own grid's RoPE and its own timestep modulation, attending only
within itself and to its own text; under context parallelism the pack is sharded like any sequence (padded to a
multiple of the CP size).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from loong.core.attention import CPGroups, shard_sequence
from loong.core.errors import LoongError
from loong.diffusion.models.wan.block import PackedDocs, WanBlock, modulated
from loong.diffusion.models.wan.config import WanConfig
from loong.diffusion.models.wan.embeddings import ConditionEmbedder
from loong.diffusion.models.wan.modulation import indexed_affine
from loong.diffusion.models.wan.norms import LayerNorm32
from loong.diffusion.models.wan.parallel import gather_shards
from loong.diffusion.models.wan.rope import grid_positions, rope_angles


def to_patches(x: torch.Tensor, patch_size: tuple[int, int, int], channels_last: bool) -> torch.Tensor:
    """``[b, c, F, H, W]`` → ``[b, tokens, c·pt·ph·pw]`` in token order (frames outermost); each patch's features
    ordered (c, pt, ph, pw) as a Conv3d weight reads them, or (pt, ph, pw, c) as the head writes them
    (``channels_last``)."""
    b, c = x.shape[:2]
    (pt, ph, pw) = patch_size
    f, h, w = (n // p for n, p in zip(x.shape[2:], patch_size, strict=True))
    x = x.reshape(b, c, f, pt, h, ph, w, pw)
    order = (0, 2, 4, 6, 3, 5, 7, 1) if channels_last else (0, 2, 4, 6, 1, 3, 5, 7)
    return x.permute(order).reshape(b, f * h * w, -1)


class WanTransformer(nn.Module):
    """Wan's diffusion transformer for one ``config``; ``groups``: context parallelism; ``capabilities``: the
    accelerator's, handed to ``cp_attention`` (its kernel choice) and to the q/k norms and RoPE (``triton``:
    loong-kernels' fused RMSNorm and rotary kernels, unless ``fused_kernels=False``).

    The training task turns ``fused_kernels`` off under ``train.compile``: inductor fuses those elementwise ops itself,
    and dynamo cannot trace into the Triton launches, so each block's graph would break in the middle (on torch 2.11
    such a break inside a block also made the compiled backward return a wrongly shaped gradient at the Wan 1.3B
    shape, ``benchmarks/results/wan_throughput_h200_20261201.json``)."""

    def __init__(self, config: WanConfig, groups: CPGroups | None = None, capabilities: Collection[str] = (),
                 fused_kernels: bool = True) -> None:
        super().__init__()
        self.config = config
        self.groups = groups or CPGroups()
        self.capabilities = frozenset(capabilities)
        # q/k RMSNorm and RoPE through loong-kernels where the accelerator has Triton ("auto": the kernels on CUDA)
        kernel_backend = "auto" if fused_kernels and "triton" in self.capabilities else None
        d = config.dim
        # a Conv3d-shaped weight (diffusers' layout), applied as one matrix product to this rank's patches only
        self.patch_embed = nn.Conv3d(config.in_channels, d, kernel_size=config.patch_size, stride=config.patch_size)
        self.condition = ConditionEmbedder(config)
        self.blocks = nn.ModuleList(WanBlock(config, self.groups, self.capabilities, kernel_backend)
                                    for _ in range(config.num_layers))
        self.norm_out = LayerNorm32(d, config.eps, affine=False)
        self.head_modulation = nn.Parameter(torch.randn(1, 2, d) / d**0.5)
        self.head = nn.Linear(d, config.out_channels * config.patch_volume)

    def grid(self, latents: torch.Tensor) -> tuple[int, int, int]:
        """The patch grid (frames, rows, columns) of ``latents [b, c, F, H, W]``; sizes must divide by the patch."""
        if latents.ndim != 5 or latents.shape[1] != self.config.in_channels:
            raise LoongError(f"Wan takes latents [batch, {self.config.in_channels}, frames, height, width], "
                             f"got {tuple(latents.shape)}")
        sizes = latents.shape[2:]
        if any(n % p for n, p in zip(sizes, self.config.patch_size, strict=True)):
            raise LoongError(f"latent frames/height/width {tuple(sizes)} must divide by the patch size "
                             f"{self.config.patch_size}")
        return tuple(n // p for n, p in zip(sizes, self.config.patch_size, strict=True))  # type: ignore[return-value]

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """A target ``[b, out_channels, F, H, W]`` as tokens ``[b, tokens, pt·ph·pw·out_channels]``, in the order
        and layout of :meth:`forward_shard`'s output (shard it with ``shard_sequence`` for a sharded loss)."""
        return to_patches(x, self.config.patch_size, channels_last=True)

    def unpatchify(self, tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Whole-sequence output tokens ``[b, tokens, pt·ph·pw·c]`` → ``[b, c, F, H, W]``."""
        (f, h, w), (pt, ph, pw) = grid, self.config.patch_size
        x = tokens.reshape(tokens.shape[0], f, h, w, pt, ph, pw, -1)
        return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(tokens.shape[0], -1, f * pt, h * ph, w * pw)

    def _check_conditions(self, timestep: torch.Tensor, text: torch.Tensor, image: torch.Tensor | None,
                          batch: int, tokens: int) -> None:
        if timestep.shape not in ((batch,), (batch, tokens)):
            raise LoongError(f"timestep must be [batch] or, per token, [batch, tokens] = [{batch}, {tokens}]; "
                             f"got {tuple(timestep.shape)}")
        if text.ndim != 3 or text.shape[0] != batch or text.shape[2] != self.config.text_dim:
            raise LoongError(f"text must be [{batch}, text_tokens, {self.config.text_dim}], got {tuple(text.shape)}")
        if (image is None) != (self.config.image_dim is None):
            raise LoongError("this Wan model takes CLIP image features (I2V): pass image" if image is None else
                             "this Wan model has no image branch (image_dim unset): do not pass image")

    def forward_shard(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                      image: torch.Tensor | None = None) -> torch.Tensor:
        """This CP rank's shard of the predicted tokens, ``[b, tokens / cp, pt·ph·pw·out_channels]``.

        ``latents [b, in_channels, F, H, W]`` whole on every rank; ``timestep [b]`` or ``[b, tokens]`` (whole
        sequence; 0-1000); ``text [b, s_text, text_dim]``; ``image [b, s_image, image_dim]`` (Wan 2.1 I2V).
        Without context parallelism this is every token.
        """
        grid = self.grid(latents)
        tokens = grid[0] * grid[1] * grid[2]
        self._check_conditions(timestep, text, image, latents.shape[0], tokens)
        # the shard of the patches first, so that each rank embeds only its own tokens
        patches = shard_sequence(to_patches(latents, self.config.patch_size, channels_last=False), self.groups, dim=1)
        x = F.linear(patches, self.patch_embed.weight.flatten(1), self.patch_embed.bias)
        positions = shard_sequence(grid_positions(*grid, device=latents.device), self.groups, dim=0)
        cos, sin = rope_angles(positions, self.config.rope_dims)
        if timestep.ndim == 2:
            timestep = shard_sequence(timestep, self.groups, dim=1)
        temb, modulation, text, image = self.condition(timestep, text, image)
        for block in self.blocks:
            x = block(x, text, image, modulation, cos, sin)
        if temb.ndim == 2:
            temb = temb.unsqueeze(1)  # one timestep a sample: the same shift and scale for every token
        shift, scale = (self.head_modulation.unsqueeze(0) + temb.unsqueeze(2)).unbind(2)
        return self.head(modulated(self.norm_out, x, shift, scale))

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                image: torch.Tensor | None = None) -> torch.Tensor:
        """The whole prediction ``[b, out_channels, F, H, W]`` (on every CP rank; arguments as in
        :meth:`forward_shard`). Under context parallelism, a loss computed from it must be the same on every CP
        rank, and the ranks' parameter gradients sum to the whole gradient (:mod:`.parallel`)."""
        tokens = gather_shards(self.forward_shard(latents, timestep, text, image), self.groups, dim=1)
        return self.unpatchify(tokens, self.grid(latents))

    def _check_packed(self, patches: torch.Tensor, positions: torch.Tensor, doc_ids: torch.Tensor,
                      timesteps: torch.Tensor, timestep_index: torch.Tensor, text: torch.Tensor,
                      text_doc_ids: torch.Tensor, image: torch.Tensor | None) -> None:
        c = self.config
        length = patches.shape[1] if patches.ndim == 3 else -1
        width = c.in_channels * c.patch_volume
        if patches.shape != (1, length, width):
            raise LoongError(f"a pack's patches must be [1, tokens, {width}] (in_channels x patch volume), got "
                             f"{tuple(patches.shape)}")
        if text.ndim != 3 or text.shape[0] != 1 or text.shape[2] != c.text_dim:
            raise LoongError(f"a pack's text must be [1, text_tokens, {c.text_dim}], got {tuple(text.shape)}")
        for name, t, shape in (("positions", positions, (length, 3)), ("doc_ids", doc_ids, (1, length)),
                               ("timestep_index", timestep_index, (length,)),
                               ("text_doc_ids", text_doc_ids, (1, text.shape[1]))):
            if tuple(t.shape) != shape:
                raise LoongError(f"a pack's {name} must be {list(shape)}, got {tuple(t.shape)}")
        if timesteps.ndim != 1:
            raise LoongError(f"a pack's timesteps are a table [K], got {tuple(timesteps.shape)}")
        if (image is None) != (c.image_dim is None):
            raise LoongError("this Wan model takes CLIP image features (I2V): pack each clip's image" if image is None
                             else "this Wan model has no image branch (image_dim unset): pack no images")
        if length % self.groups.size:
            raise LoongError(f"a pack of {length} tokens does not split into {self.groups.size} context-parallel "
                             f"shards; pack it with multiple={self.groups.size}")

    def forward_packed(self, patches: torch.Tensor, positions: torch.Tensor, doc_ids: torch.Tensor,
                       timesteps: torch.Tensor, timestep_index: torch.Tensor, text: torch.Tensor,
                       text_doc_ids: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        """This CP rank's shard of the predicted tokens of a pack of clips, ``[1, L / cp, pt·ph·pw·out_channels]``
        (:func:`~loong.diffusion.models.wan.packed.pack_clips` builds the arguments, whole on every rank).

        Each clip is predicted as :meth:`forward_shard` would predict it alone: RoPE over its own grid, its own
        timestep(s), self-attention within the clip and cross-attention to its own text (and image) tokens only.
        Padding tokens (``doc_ids`` −1) predict garbage that a loss must leave out (weight 0).
        """
        self._check_packed(patches, positions, doc_ids, timesteps, timestep_index, text, text_doc_ids, image)
        g = self.groups
        x = F.linear(shard_sequence(patches, g, dim=1), self.patch_embed.weight.flatten(1), self.patch_embed.bias)
        cos, sin = rope_angles(shard_sequence(positions, g, dim=0), self.config.rope_dims)
        index = shard_sequence(timestep_index, g, dim=0)
        # temb [K, dim], modulation [K, 6, dim]: one row per distinct timestep of the pack
        temb, modulation, text, image = self.condition(timesteps, text, image)
        image_docs = None
        if image is not None:  # [clips, s_image, dim] embedded as a batch, then one sequence with its clip ids
            image_docs = torch.arange(image.shape[0], device=image.device).repeat_interleave(image.shape[1])[None]
            image = image.reshape(1, -1, image.shape[-1])
        packed = PackedDocs(shard_sequence(doc_ids, g, dim=1), text_doc_ids, image_docs, index)
        for block in self.blocks:
            x = block(x, text, image, modulation, cos, sin, packed)
        shift, scale = (self.head_modulation[0] + temb.unsqueeze(1)).unbind(1)
        return self.head(indexed_affine(self.norm_out(x.float()), 1 + scale, shift, index).to(x.dtype))

    def num_parameters(self) -> int:
        """Parameters of this module (one expert)."""
        return sum(p.numel() for p in self.parameters())


__all__ = ["WanTransformer", "to_patches"]
