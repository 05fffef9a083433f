"""Helpers of the preprocess and shard tests: tiny videos (PyAV) and images (Pillow) written in-process, a manifest
of them, the CLI call, the independent reference of one clip (decode, cut, encode with diffusers' VAE) and reading
a shard folder back."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import torch


def frame_pattern(index: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth RGB frame that differs from frame to frame (a moving gradient and a square), uint8."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = 0.6 * index + seed
    r = 127 + 100 * np.sin(x / 5.0 + phase)
    g = 127 + 100 * np.cos(y / 4.0 - phase)
    b = np.full_like(x, 40.0 + 15 * index % 200)
    top, left = (3 * index) % max(1, height - 8), (5 * index + seed) % max(1, width - 8)
    b[top:top + 8, left:left + 8] = 230
    return np.clip(np.stack([r, g, b], axis=-1), 0, 255).astype(np.uint8)


def write_video(path: Path, frames: int, height: int, width: int, fps: int = 8, seed: int = 0) -> Path:
    """An MPEG-4 video of ``frames`` :func:`frame_pattern` frames."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pattern(i, height, width, seed), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_image(path: Path, height: int, width: int, seed: int = 0) -> Path:
    """A PNG of one :func:`frame_pattern` frame."""
    from PIL import Image

    Image.fromarray(frame_pattern(seed, height, width, seed)).save(path)
    return path


def write_manifest(path: Path, rows: list[dict | str]) -> Path:
    """A JSONL manifest: dict rows as JSON, string rows verbatim (for broken lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run_cli(*argv: str) -> tuple[int, str]:
    """``loong-diffusion ARGV`` in-process: exit code and everything it printed."""
    from loong.diffusion.cli import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(list(argv))
        except SystemExit as exc:  # argparse
            rc = int(exc.code or 0)
    return rc, out.getvalue() + err.getvalue()


def decoded_frames(path: Path) -> list[np.ndarray]:
    """Every frame of a video as RGB uint8 arrays, decoded with PyAV directly."""
    import av

    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def reference_latents(vae_dir: Path, frames: list[np.ndarray], resize_to: tuple[int, int],
                      crop: tuple[int, int, int, int]) -> torch.Tensor:
    """The oracle: ``frames`` resized (bicubic) to ``resize_to`` = (width, height), cropped to ``crop`` =
    (left, top, right, bottom), scaled to [-1, 1], encoded by diffusers' ``AutoencoderKLWan`` (the latent
    distribution's mean) and normalised with the VAE config's ``latents_mean`` / ``latents_std``."""
    from diffusers import AutoencoderKLWan
    from PIL import Image

    vae = AutoencoderKLWan.from_pretrained(vae_dir).eval()
    cut = [np.asarray(Image.fromarray(f).resize(resize_to, Image.Resampling.BICUBIC).crop(crop)) for f in frames]
    x = torch.from_numpy(np.stack(cut)).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return ((z - mean) / std)[0]


def read_folder(out: Path) -> list[dict]:
    """Every clip of a preprocess folder, in order: its sidecar record plus ``latents`` and ``text`` tensors."""
    from safetensors.torch import load_file

    clips, number = [], 0
    while (sidecar := out / f"shard-{number:05d}.json").is_file():
        side = json.loads(sidecar.read_text())
        tensors = load_file(out / side["shard"]) if side["shard"] else {}
        for j, s in enumerate(side["samples"]):
            clips.append({**s, "latents": tensors[f"{j}.latents"], "text": tensors[f"{j}.text"]})
        number += 1
    return clips
