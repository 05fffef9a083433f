"""Images and videos from local files: a cheap *probe* (size, frame count, frame rate) at setup, and the full
*decode* in DataLoader workers.

The probe reads headers only (and, for PNG, checks every chunk's CRC through :meth:`PIL.Image.Image.verify`),
which is enough to plan a sample's placeholder tokens without decoding pixels; what only a full decode can
find (a truncated JPEG, a damaged video packet) is found in the worker. Every failure raises
:class:`MediaError`, whose ``kind`` names the reason for the skip counts (``missing media``, ``bad image``,
``bad video``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


class MediaError(ValueError):
    """A media file that cannot be used; ``kind`` names the reason, ``path`` the file."""

    def __init__(self, kind: str, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.kind = kind
        self.path = path


@dataclass(frozen=True)
class ImageInfo:
    """An image's size in pixels."""

    width: int
    height: int


@dataclass(frozen=True)
class VideoInfo:
    """A video's first video stream: frame count, frames per second and frame size."""

    total_frames: int
    fps: float
    width: int
    height: int


def _exists(path: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise MediaError("missing media", path, "no such file" if not p.exists() else "not a file")
    return p


def probe_image(path: str) -> ImageInfo:
    """Size of the image at ``path``; raises :class:`MediaError` for a missing, unidentifiable or
    (PNG) truncated file."""
    from PIL import Image, UnidentifiedImageError

    _exists(path)
    try:
        with Image.open(path) as im:
            size = im.size
            im.verify()  # PNG: every chunk read and CRC-checked; other formats: header sanity
    except UnidentifiedImageError:
        raise MediaError("bad image", path, "not an image PIL can read") from None
    except (OSError, SyntaxError, ValueError) as exc:  # PIL reports truncation and bad chunks this way
        raise MediaError("bad image", path, f"damaged image ({exc})") from None
    if size[0] < 1 or size[1] < 1:
        raise MediaError("bad image", path, f"empty image ({size[0]}x{size[1]})")
    return ImageInfo(int(size[0]), int(size[1]))


def load_image(path: str):  # noqa: ANN201 (PIL.Image.Image; PIL is imported lazily)
    """The image at ``path`` decoded in full, as RGB."""
    from PIL import Image, UnidentifiedImageError

    _exists(path)
    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB")
    except UnidentifiedImageError:
        raise MediaError("bad image", path, "not an image PIL can read") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError("bad image", path, f"cannot decode the image ({exc})") from None


def _open_video(path: str):  # noqa: ANN202 (av.container.InputContainer)
    import av

    _exists(path)
    try:
        container = av.open(path)
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise MediaError("bad video", path, f"not a video PyAV can open ({exc})") from None
    if not container.streams.video:
        container.close()
        raise MediaError("bad video", path, "has no video stream")
    return container


def probe_video(path: str) -> VideoInfo:
    """Frame count, frame rate and size of the first video stream at ``path`` (no frame is decoded)."""
    import av

    container = _open_video(path)
    try:
        stream = container.streams.video[0]
        frames = int(stream.frames or 0)
        if frames == 0:  # containers without a frame count in the header: count the packets instead
            try:
                frames = sum(1 for packet in container.demux(stream) if packet.size)
            except (av.FFmpegError, OSError) as exc:
                raise MediaError("bad video", path, f"damaged video ({exc})") from None
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        width, height = int(stream.width or 0), int(stream.height or 0)
    finally:
        container.close()
    if frames < 1:
        raise MediaError("bad video", path, "has no frames")
    if fps <= 0:
        raise MediaError("bad video", path, "has no frame rate")
    if width < 1 or height < 1:
        raise MediaError("bad video", path, f"has an empty frame size ({width}x{height})")
    return VideoInfo(frames, fps, width, height)


def load_video_frames(path: str, indices: list[int]) -> np.ndarray:
    """Frames ``indices`` (sorted, 0-based) of the first video stream, ``[len(indices), H, W, 3]`` uint8 RGB."""
    import av

    wanted = sorted(set(int(i) for i in indices))
    if not wanted:
        raise MediaError("bad video", path, "no frame was asked for")
    container = _open_video(path)
    frames: dict[int, np.ndarray] = {}
    try:
        for i, frame in enumerate(container.decode(video=0)):
            if i > wanted[-1]:
                break
            if i in wanted:
                frames[i] = frame.to_ndarray(format="rgb24")
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise MediaError("bad video", path, f"cannot decode the video ({exc})") from None
    finally:
        container.close()
    if len(frames) < len(wanted):
        raise MediaError("bad video", path, f"decoded {len(frames)} of the {len(wanted)} frames asked for "
                                            f"(up to frame {wanted[-1]}): the file is truncated")
    return np.stack([frames[int(i)] for i in indices])
