"""Reading a row's media and cutting it to its bucket: videos through PyAV (FFmpeg), images through Pillow.

A video is read twice: once demuxed without decoding (its packet count is its frame count, its stream gives size and
rate), so that the bucket and the frames to keep are known before any pixel is decoded; then decoded up to the last
frame kept, converting only the kept ones to RGB. A long video thus costs the memory of one bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loong.diffusion.preprocess.buckets import (
    Bucket,
    choose_bucket,
    cover_size,
    frame_indices,
    no_bucket_reason,
    usable_frames,
)
from loong.diffusion.preprocess.manifest import Row


@dataclass(frozen=True)
class Clip:
    """A row cut to its bucket: ``pixels`` ``[3, frames, height, width]`` in [-1, 1] (float32), and the source's
    size for the index."""

    bucket: Bucket
    pixels: torch.Tensor
    source_frames: int
    source_height: int
    source_width: int
    frames_kept: list[int]


def _fit(frame, bucket: Bucket):  # noqa: ANN001, ANN202 (PIL images)
    """Resize a PIL image (bicubic, aspect kept) to just cover the bucket, then centre-crop it to the bucket."""
    from PIL import Image

    height, width = cover_size(bucket, frame.height, frame.width)
    if (height, width) != (frame.height, frame.width):
        frame = frame.resize((width, height), Image.Resampling.BICUBIC)
    top, left = (height - bucket.height) // 2, (width - bucket.width) // 2
    return frame.crop((left, top, left + bucket.width, top + bucket.height))


def to_pixels(frames: Sequence) -> torch.Tensor:  # noqa: ANN001
    """PIL RGB frames → ``[3, frames, height, width]`` float32 in [-1, 1] (the VAE's input range)."""
    array = np.stack([np.asarray(f, dtype=np.uint8) for f in frames])  # [f, h, w, 3]
    return torch.from_numpy(array).permute(3, 0, 1, 2).float().div(127.5).sub(1.0).contiguous()


def _image(row: Row, buckets: Sequence[Bucket]) -> Clip:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(row.path) as img:
            img = img.convert("RGB")
    except FileNotFoundError:
        raise row.error(f"image {row.source} not found ({row.path})") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise row.error(f"cannot read image {row.source}: {exc}") from None
    bucket = choose_bucket(buckets, 1, img.height, img.width, is_image=True)
    if bucket is None:
        raise row.error(no_bucket_reason(buckets, 1, img.height, img.width, is_image=True))
    return Clip(bucket, to_pixels([_fit(img, bucket)]), 1, img.height, img.width, [0])


def _video(row: Row, buckets: Sequence[Bucket], fps: float | None) -> Clip:
    import av

    if not row.path.is_file():
        raise row.error(f"video {row.source} not found ({row.path})")
    try:
        with av.open(str(row.path)) as container:
            if not container.streams.video:
                raise row.error(f"{row.source} has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            height, width = stream.codec_context.height, stream.codec_context.width
            count = sum(1 for packet in container.demux(stream) if packet.size)
        if not rate or not count or not height or not width:
            raise row.error(f"{row.source}: no frames, size or frame rate in its video stream")
        usable, step = usable_frames(count, float(rate), fps)
        bucket = choose_bucket(buckets, usable, height, width, is_image=False)
        if bucket is None:
            raise row.error(no_bucket_reason(buckets, usable, height, width, is_image=False))
        wanted = frame_indices(bucket, usable, step)
        keep = set(wanted)
        frames: dict[int, object] = {}
        with av.open(str(row.path)) as container:
            for index, frame in enumerate(container.decode(video=0)):
                if index in keep:
                    frames[index] = _fit(frame.to_image(), bucket)
                if index >= wanted[-1]:
                    break
    except av.FFmpegError as exc:
        raise row.error(f"cannot decode video {row.source}: {exc}") from None
    if len(frames) < len(keep):
        raise row.error(f"{row.source}: decoded only {len(frames)} of the frames {wanted} "
                        f"(the container lists {count} packets)")
    return Clip(bucket, to_pixels([frames[i] for i in wanted]), count, height, width, wanted)


def load_clip(row: Row, buckets: Sequence[Bucket], fps: float | None = None) -> Clip:
    """Read ``row``'s media and cut it to its bucket (:mod:`~loong.diffusion.preprocess.buckets`' rule); a
    :class:`~loong.diffusion.preprocess.manifest.RowError` when it is missing, unreadable or fits no bucket."""
    return _image(row, buckets) if row.kind == "image" else _video(row, buckets, fps)


__all__ = ["Clip", "load_clip", "to_pixels"]
