"""Pictures a person can look at: latents shown as colours, several clips side by side, an animated GIF.

Without a VAE (the synthetic runs have none: their latents are made up, not a VAE's) a latent clip is shown as
colours: each position's channel vector is projected onto three fixed orthonormal directions of the channel space
(red, green, blue), scaled by the clip's largest projection, with 0 at mid grey. So the synthetic set's blob of a
class shows as one coloured disc on grey, moving as its class moves; it says nothing about what a VAE would decode.
With a VAE the frames are its decoded pixels.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

#: each clip's smaller side is scaled up (nearest neighbour) to at least this many pixels: latents are tiny
MIN_SIDE = 128


def latent_colours(latents: torch.Tensor) -> torch.Tensor:
    """Latents ``[b, c, F, H, W]`` → frames ``[b, F, H, W, 3]`` in [0, 1] (see the module docstring); the
    directions depend only on ``c``, so clips of one model always get the same colours."""
    c = latents.shape[1]
    g = torch.Generator().manual_seed(c)
    basis, _ = torch.linalg.qr(torch.randn(c, 3, generator=g, dtype=torch.float64))  # orthonormal columns
    x = torch.einsum("bcfhw,ck->bfhwk", latents.detach().double().cpu(), basis[:, : min(3, c)])
    if x.shape[-1] < 3:  # fewer than three channels: the rest of the colour stays grey
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], 3 - x.shape[-1])], dim=-1)
    scale = x.flatten(1).abs().amax(dim=1).clamp_min(1e-12).view(-1, 1, 1, 1, 1)
    return (0.5 + 0.5 * x / scale).float()


def tile(frames: torch.Tensor, columns: int | None = None, gap: int = 2, min_side: int = MIN_SIDE) -> torch.Tensor:
    """Clips ``[b, F, H, W, 3]``, each scaled up (nearest neighbour, a whole factor) until its smaller side has at
    least ``min_side`` pixels, side by side in a grid (``columns``: default about square) with ``gap`` white pixels
    between them → ``[F, H', W', 3]``."""
    scale = max(1, math.ceil(min_side / min(frames.shape[2:4])))
    frames = frames.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
    b, f, h, w, _ = frames.shape
    columns = columns or math.ceil(math.sqrt(b))
    rows = math.ceil(b / columns)
    out = torch.ones(f, rows * h + (rows - 1) * gap, columns * w + (columns - 1) * gap, 3)
    for i in range(b):
        r, c = divmod(i, columns)
        out[:, r * (h + gap): r * (h + gap) + h, c * (w + gap): c * (w + gap) + w] = frames[i]
    return out


def write_gif(frames: torch.Tensor, path: str | Path, fps: float = 8.0) -> Path:
    """Write ``frames`` ``[F, H, W, 3]`` in [0, 1] as a looping GIF at ``fps``; returns the path. (Pillow merges
    consecutive frames that are exactly equal into one longer frame.)"""
    from PIL import Image

    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [frames, height, width, 3], got {tuple(frames.shape)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = (frames.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    images = [Image.fromarray(p) for p in pixels]
    duration = max(20, round(1000 / fps))  # ms; browsers treat shorter GIF delays as 100 ms
    images[0].save(path, save_all=True, append_images=images[1:], duration=duration, loop=0, disposal=1)
    return path


__all__ = ["MIN_SIDE", "latent_colours", "tile", "write_gif"]
