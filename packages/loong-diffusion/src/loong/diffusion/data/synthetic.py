"""A synthetic latent-video set generated from its seed: "moving shapes" with matching text features.

Clip ``i`` belongs to class ``i % num_classes``. The class fixes the motion (a Gaussian blob's velocity across the
frames), the blob's channel pattern and the clip's text features (a fixed random vector sequence); the clip itself
only picks where the blob starts. So the text tells the model what moves how, and a denoiser can learn it: the
flow-matching loss falls well below that of an untrained model. Every clip is a pure function of
(seed, clip index), so resumed runs and every parallel layout read the same data, and nothing is stored on disk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: the blob's radius as a fraction of the latent frame's smaller side
BLOB_RADIUS = 0.18
#: offsets of the generators' seeds, so that class, clip and size streams never coincide
_CLASS_STREAM, _CLIP_STREAM, _SIZE_STREAM = 1_000_003, 7_919, 104_729


def _generator(*parts: int) -> torch.Generator:
    seed = 0
    for part in parts:
        seed = (seed * 1_000_000_007 + part) % (2**63 - 1)  # a stable mix of the parts (Python's hash() is not)
    return torch.Generator().manual_seed(seed)


class MovingShapes:
    """``num_clips`` latent clips ``[channels, frames, height, width]`` and text features ``[text_len, text_dim]``.

    ``sizes``: several latent sizes ``(frames, height, width)`` (buckets of resolution and duration) instead of the
    one ``frames × height × width``; each clip draws its size uniformly from them, seeded by (seed, clip), from a
    stream of its own (its class, motion and text are drawn as with one size).
    """

    def __init__(self, *, num_clips: int, num_classes: int, channels: int, frames: int, height: int, width: int,
                 text_len: int, text_dim: int, seed: int,
                 sizes: Sequence[tuple[int, int, int]] | None = None) -> None:
        self.num_clips, self.num_classes, self.seed = num_clips, num_classes, seed
        self.channels, self.frames, self.height, self.width = channels, frames, height, width
        self.text_len, self.text_dim = text_len, text_dim
        self.sizes = [tuple(s) for s in sizes] if sizes else [(frames, height, width)]

    def __len__(self) -> int:
        return self.num_clips

    def size_of(self, clip: int) -> tuple[int, int, int]:
        """The latent ``(frames, height, width)`` of clip ``clip % num_clips``."""
        if len(self.sizes) == 1:
            return self.sizes[0]
        g = _generator(self.seed, _SIZE_STREAM, clip % self.num_clips)
        return self.sizes[int(torch.randint(len(self.sizes), (), generator=g))]

    def class_of(self, clip: int) -> int:
        """The class (motion, pattern, caption) of clip ``clip``."""
        return clip % self.num_classes

    def text(self, label: int) -> torch.Tensor:
        """The text features of class ``label``, ``[text_len, text_dim]`` (unit variance, as an encoder's are
        after Wan's text projection would see them)."""
        g = _generator(self.seed, _CLASS_STREAM, label, 1)
        return torch.randn(self.text_len, self.text_dim, generator=g)

    def clip(self, clip: int) -> dict[str, torch.Tensor]:
        """Clip ``clip % num_clips``: ``latents [channels, frames, height, width]`` (its :meth:`size_of`) and its
        class's ``text``."""
        clip %= self.num_clips
        label = self.class_of(clip)
        frames, height, width = self.size_of(clip)
        g_class = _generator(self.seed, _CLASS_STREAM, label, 0)
        angle = torch.rand((), generator=g_class) * 2 * torch.pi
        speed = 0.5 + torch.rand((), generator=g_class)  # latent pixels per frame, relative to the smaller side / 8
        pattern = torch.randn(self.channels, generator=g_class)
        g_clip = _generator(self.seed, _CLIP_STREAM, clip)
        start = torch.rand(2, generator=g_clip) * torch.tensor([height, width])
        side = min(height, width)
        step = speed * side / 8 * torch.stack([torch.sin(angle), torch.cos(angle)])
        t = torch.arange(frames, dtype=torch.float32)
        centre = start[None] + t[:, None] * step[None]  # [frames, 2]
        # wrap around the frame, as a torus, so that every clip keeps its blob in view
        rows = torch.arange(height, dtype=torch.float32)
        cols = torch.arange(width, dtype=torch.float32)
        dy = torch.remainder(rows[None] - centre[:, :1] + height / 2, height) - height / 2
        dx = torch.remainder(cols[None] - centre[:, 1:] + width / 2, width) - width / 2
        radius = BLOB_RADIUS * side
        blob = torch.exp(-(dy[:, :, None] ** 2 + dx[:, None, :] ** 2) / (2 * radius**2))  # [frames, h, w]
        latents = pattern[:, None, None, None] * blob[None]
        return {"latents": latents, "text": self.text(label)}


__all__ = ["MovingShapes"]
