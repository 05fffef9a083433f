"""Packing several clips of different sizes into one Wan sequence (:meth:`WanTransformer.forward_packed`).

A *pack* is one sequence (batch 1) holding clips ``0 .. n - 1`` one after the other, each clip's tokens in its own
patch order, then padding up to a multiple (the context-parallel size). :func:`pack_clips` builds it on the host:

- ``patches [1, L, in_channels·pt·ph·pw]``: every clip's patches (in the Conv3d layout the patch embedding
  reads), zeros for padding;
- ``positions [L, 3]``: each clip's own (frame, row, column) grid from 0, so RoPE rotates a clip as it would alone;
- ``doc_ids [1, L]``: the clip of each token, ``-1`` for padding (self-attention is block-diagonal over them,
  padding attends to nothing and gets 0 from attention);
- ``timesteps [K]`` and ``timestep_index [L]``: the distinct timesteps of the pack and each token's entry, so
  every clip's tokens get their clip's timestep, or their own per-token one (Wan 2.2 TI2V's 0 on the conditioning
  frame); the timestep MLP then runs on ``K`` values, not ``L`` tokens;
- ``text [1, S, text_dim]`` / ``text_doc_ids [1, S]``: every clip's text tokens (any lengths) with their clip, so
  each clip's cross-attention reads only its own text; ``image [n·m, s_img, image_dim]`` (I2V) each clip's CLIP
  tokens as a batch, embedded as the unpacked model embeds them;
- ``grids [n, 3]``: each clip's patch grid (to unpack predictions), and with targets ``target [1, L,
  pt·ph·pw·out_channels]`` (the head's layout) and ``token_weight [1, L]`` (``weight_i / (tokens_i · features)``
  on clip ``i``'s tokens, or with a token mask ``weight_i · m_t / (Σ m · features)``; 0 on padding), so that
  :func:`packed_mse` is ``Σ_i weight_i · MSE_i``.

Each packed token takes its timestep entry's modulation (:mod:`.modulation`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from loong.core.errors import LoongError
from loong.diffusion.models.wan.model import to_patches
from loong.diffusion.models.wan.rope import grid_positions

#: the keys of a pack that :meth:`WanTransformer.forward_packed` takes (``image`` only for I2V models)
PACK_INPUTS = ("patches", "positions", "doc_ids", "timesteps", "timestep_index", "text", "text_doc_ids", "image")


def _per_token_timesteps(timestep: torch.Tensor, tokens: int, clip: int) -> torch.Tensor:
    if timestep.numel() == 1:
        return timestep.reshape(1).float().expand(tokens)
    if timestep.shape != (tokens,):
        raise LoongError(f"clip {clip}: a timestep must be one value or one per token [{tokens}], got "
                         f"{tuple(timestep.shape)}")
    return timestep.float()


def _grid(latents: torch.Tensor, patch_size: tuple[int, int, int], clip: int) -> tuple[int, int, int]:
    if latents.ndim != 4 or any(n % p for n, p in zip(latents.shape[1:], patch_size, strict=True)):
        raise LoongError(f"clip {clip}: latents must be [channels, frames, height, width] with sizes divisible by "
                         f"the patch size {tuple(patch_size)}, got {tuple(latents.shape)}")
    return tuple(n // p for n, p in zip(latents.shape[1:], patch_size, strict=True))  # type: ignore[return-value]


def _patches(x: torch.Tensor, patch_size: tuple[int, int, int], channels_last: bool) -> torch.Tensor:
    return to_patches(x[None], patch_size, channels_last)[0]


def _token_weights(tokens: int, weight: float, mask: torch.Tensor | None, features: int,
                   clip: int) -> torch.Tensor:
    """``weight · mask / (max(Σ mask, 1) · features)``: a clip's (masked) MSE times its weight, spread over its
    tokens."""
    if mask is None:
        return torch.full((tokens,), float(weight) / (tokens * features))
    if mask.shape != (tokens,):
        raise LoongError(f"clip {clip}: a token mask must be [{tokens}], got {tuple(mask.shape)}")
    mask = mask.float()
    return mask * (float(weight) / (float(mask.sum().clamp_min(1)) * features))


def pack_clips(latents: Sequence[torch.Tensor], timesteps: Sequence[torch.Tensor], texts: Sequence[torch.Tensor],
               patch_size: Sequence[int], *, images: Sequence[torch.Tensor] | None = None,
               targets: Sequence[torch.Tensor] | None = None, weights: Sequence[float] | None = None,
               token_masks: Sequence[torch.Tensor | None] | None = None, multiple: int = 1) -> dict[str, torch.Tensor]:
    """One pack of clips ``i``: ``latents[i] [in_channels, F, H, W]``, ``timesteps[i]`` (one value, or one per
    token), ``texts[i] [s_i, text_dim]``, optionally ``images[i] [m, s_img, image_dim]`` (or ``[s_img,
    image_dim]``; the same ``m`` and ``s_img`` for every clip), ``targets[i] [out_channels, F, H, W]``,
    ``weights[i]`` (default 1) and ``token_masks[i] [tokens_i]`` (per-token loss weights, e.g. 0 on TI2V's
    conditioning frame; the clip's MSE is then ``Σ m·err / max(Σ m, 1)``, default all 1); padded to a multiple of
    ``multiple`` tokens. The keys are in the module docstring.
    """
    n = len(latents)
    if n == 0 or len(timesteps) != n or len(texts) != n:
        raise LoongError(f"a pack needs at least one clip and one timestep and text per clip; got {n} latents, "
                         f"{len(timesteps)} timesteps, {len(texts)} texts")
    patch = tuple(int(p) for p in patch_size)
    grids = [_grid(x, patch, i) for i, x in enumerate(latents)]
    counts = [f * h * w for f, h, w in grids]
    real = sum(counts)
    length = -(-real // multiple) * multiple
    pad = length - real
    doc = torch.cat([torch.full((c,), i, dtype=torch.long) for i, c in enumerate(counts)]
                    + [torch.full((pad,), -1, dtype=torch.long)])
    per_token = torch.cat([_per_token_timesteps(t, c, i) for i, (t, c) in enumerate(zip(timesteps, counts,
                                                                                        strict=True))])
    table, index = torch.unique(per_token, return_inverse=True)
    patches = torch.cat([_patches(x, patch, channels_last=False) for x in latents])
    positions = torch.cat([grid_positions(*g) for g in grids])
    out = {
        "patches": F.pad(patches, (0, 0, 0, pad))[None],
        "positions": F.pad(positions, (0, 0, 0, pad)),
        "doc_ids": doc[None],
        "timesteps": table,
        "timestep_index": F.pad(index, (0, pad)),
        "text": torch.cat(list(texts))[None],
        "text_doc_ids": torch.cat([torch.full((t.shape[0],), i, dtype=torch.long) for i, t in enumerate(texts)])[None],
        "grids": torch.tensor(grids, dtype=torch.long),
    }
    if images is not None:
        out["image"] = torch.cat([im if im.ndim == 3 else im[None] for im in images])
    if targets is not None:
        weights = [1.0] * n if weights is None else list(weights)
        masks = [None] * n if token_masks is None else list(token_masks)
        target = torch.cat([_patches(y, patch, channels_last=True) for y in targets])
        features = target.shape[-1]
        token_weight = torch.cat([_token_weights(c, w, m, features, i)
                                  for i, (c, w, m) in enumerate(zip(counts, weights, masks, strict=True))])
        out["target"] = F.pad(target, (0, 0, 0, pad))[None]
        out["token_weight"] = F.pad(token_weight, (0, pad))[None]
    return out


def packed_mse(pred: torch.Tensor, target: torch.Tensor, token_weight: torch.Tensor) -> torch.Tensor:
    """``Σ_t token_weight[t] · Σ_f (pred − target)²`` over the tokens of ``pred [1, s, f]`` (a pack or one CP
    rank's shard of it, with the same shard of ``target`` and ``token_weight``), in float32: with
    :func:`pack_clips`' weights, ``Σ_i weight_i · MSE_i`` over the clips (their tokens in this shard)."""
    err = (pred.float() - target.float()).pow(2).sum(-1)
    return (err * token_weight.float()).sum()


def unpack_tokens(tokens: torch.Tensor, grids: torch.Tensor, patch_size: Sequence[int]) -> list[torch.Tensor]:
    """A whole pack's output tokens ``[1, L, pt·ph·pw·c]`` → each clip's ``[c, F, H, W]`` (padding dropped)."""
    (pt, ph, pw), out, at = patch_size, [], 0
    for f, h, w in grids.tolist():
        x = tokens[0, at:at + f * h * w].reshape(f, h, w, pt, ph, pw, -1)
        out.append(x.permute(6, 0, 3, 1, 4, 2, 5).reshape(-1, f * pt, h * ph, w * pw))
        at += f * h * w
    return out


__all__ = ["PACK_INPUTS", "pack_clips", "packed_mse", "unpack_tokens"]
