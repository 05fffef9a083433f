"""Resolution/duration buckets: which ``(frames, height, width)`` a clip is cut to, and how.

The rule (each step deterministic):

1. **Frame rate.** A video is read at ``fps`` (default: its own rate; never faster than its own rate, so no frame
   is repeated): output frame ``k`` is source frame ``floor(k · source_rate / fps)``. That gives it ``m`` usable
   frames; an image has one.
2. **Which buckets it can fill.** A video can fill a bucket with ``1 < frames ≤ m``; an image only the 1-frame
   buckets. Either only a bucket no larger than itself: ``height ≤`` its height and ``width ≤`` its width (nothing
   is upscaled).
3. **Which one.** Of those, the bucket whose aspect ratio is nearest the clip's (smallest
   ``|log(w/h) − log(W/H)|``); on a tie the one with the most pixels × frames; then the first listed.
4. **Cut.** The clip is resized (bicubic, aspect kept) to the smallest size that covers the bucket, then
   centre-cropped to it; of its ``m`` frames, the ``frames`` in the middle are kept (start ``(m − frames) // 2``).

A clip that can fill no bucket is a row error (``--on-error skip`` counts it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loong.core.errors import LoongError

#: Wan 2.1 / 2.2 480p: 81 frames (5 s at 16 fps) and 33, landscape, portrait and square, plus stills
DEFAULT_BUCKETS = "81x480x832,81x832x480,81x624x624,33x480x832,33x832x480,33x624x624,1x480x832,1x832x480,1x624x624"


@dataclass(frozen=True, order=True)
class Bucket:
    """A target clip shape in pixels: ``frames`` (4k+1 for Wan's VAE), ``height``, ``width``."""

    frames: int
    height: int
    width: int

    @property
    def name(self) -> str:
        """``FxHxW``, as written on the command line and in the index."""
        return f"{self.frames}x{self.height}x{self.width}"

    @property
    def aspect(self) -> float:
        return self.width / self.height


def parse_buckets(spec: str | Sequence[str], temporal: int = 4, spatial: int = 8) -> list[Bucket]:
    """``"81x480x832,1x480x832"`` (or a list of ``FxHxW``) → buckets, checked against the VAE's compression:
    ``frames`` = ``temporal``·k + 1, ``height`` and ``width`` multiples of ``spatial``; no duplicates."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not items:
        raise LoongError("--buckets: empty; give FRAMESxHEIGHTxWIDTH,... e.g. 81x480x832,1x480x832")
    buckets: list[Bucket] = []
    for item in items:
        parts = item.lower().split("x")
        try:
            frames, height, width = (int(p) for p in parts)
        except ValueError:
            raise LoongError(f"--buckets: {item!r} is not FRAMESxHEIGHTxWIDTH (three integers, e.g. 81x480x832)"
                             ) from None
        if frames < 1 or (frames - 1) % temporal:
            raise LoongError(f"--buckets: {item}: frames must be {temporal}k+1 (1, {temporal + 1}, "
                             f"{2 * temporal + 1}, ..., 81), the VAE compresses time {temporal}x after the first")
        if height < spatial or width < spatial or height % spatial or width % spatial:
            raise LoongError(f"--buckets: {item}: height and width must be positive multiples of {spatial}, "
                             f"the VAE's spatial compression")
        bucket = Bucket(frames, height, width)
        if bucket in buckets:
            raise LoongError(f"--buckets: {item} is listed twice")
        buckets.append(bucket)
    return buckets


def usable_frames(source_frames: int, source_rate: float, fps: float | None) -> tuple[int, float]:
    """``(m, step)``: frames available at ``fps`` and the source-frame step between them (step ≥ 1)."""
    step = 1.0 if fps is None or fps >= source_rate else source_rate / fps
    if source_frames < 1:
        return 0, step
    return math.floor((source_frames - 1) / step + 1e-9) + 1, step


def choose_bucket(buckets: Sequence[Bucket], frames: int, height: int, width: int, is_image: bool) -> Bucket | None:
    """The bucket a clip of ``frames`` usable frames and ``height`` × ``width`` pixels goes to (module rule),
    or None when it can fill none."""
    fits = [b for b in buckets
            if (b.frames == 1 if is_image else 1 < b.frames <= frames) and b.height <= height and b.width <= width]
    if not fits:
        return None
    target = math.log(width / height)
    order = {b: i for i, b in enumerate(buckets)}
    return min(fits, key=lambda b: (round(abs(math.log(b.aspect) - target), 9), -b.frames * b.height * b.width,
                                    order[b]))


def frame_indices(bucket: Bucket, usable: int, step: float) -> list[int]:
    """The source frames of the bucket's centre window of ``usable`` frames sampled every ``step``."""
    start = (usable - bucket.frames) // 2
    return [math.floor((start + k) * step + 1e-9) for k in range(bucket.frames)]


def cover_size(bucket: Bucket, height: int, width: int) -> tuple[int, int]:
    """``(height, width)`` of the aspect-keeping resize that just covers the bucket."""
    scale = max(bucket.height / height, bucket.width / width)
    return max(bucket.height, round(height * scale)), max(bucket.width, round(width * scale))


def no_bucket_reason(buckets: Sequence[Bucket], frames: int, height: int, width: int, is_image: bool) -> str:
    """Why :func:`choose_bucket` found nothing, for the row's error."""
    what = "image" if is_image else f"video of {frames} usable frames"
    kinds = [b for b in buckets if (b.frames == 1) == is_image]
    if not kinds:
        return f"no bucket for {'images (add a 1-frame bucket, e.g. 1x480x832)' if is_image else 'videos'}"
    if not is_image and all(b.frames > frames for b in kinds):
        return (f"{what}: too short for every video bucket (the shortest needs {min(b.frames for b in kinds)} "
                "frames; lower --fps or add a shorter bucket)")
    return (f"{what} of {height}x{width} pixels is smaller than every bucket it could fill "
            f"({', '.join(b.name for b in kinds)}); clips are never upscaled")


__all__ = ["DEFAULT_BUCKETS", "Bucket", "choose_bucket", "cover_size", "frame_indices", "no_bucket_reason",
           "parse_buckets", "usable_frames"]
