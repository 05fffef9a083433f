"""The image side of image-to-video preprocessing (``--condition``, ``--image-encoder``): the frames a clip is
conditioned on, and their CLIP image features as ``WanImageToVideoPipeline.encode_image`` computes them.

Conditions (what the model sees of the clip at inference):

* ``first``: the first frame (Wan 2.1 I2V, Wan 2.2 I2V A14B);
* ``first_last``: the first and the last frame (Wan 2.1 FLF2V).

The condition latent is the VAE latent of the clip with every other pixel frame set to zero (the pipeline's
``video_condition``: the frames, then zeros; for ``first_last`` the last frame after the zeros). The CLIP features
are the image encoder's penultimate hidden state of the conditioning frames as the image processor prepares them
(resize, centre crop, CLIP normalisation), their tokens joined in frame order: ``[images · tokens, dim]``, what the
FLF2V transformer joins the pipeline's ``[2, tokens, dim]`` into.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from loong.core.errors import LoongError
from loong.diffusion.devices import cli_device
from loong.diffusion.preprocess.encode import _digest

Condition = Literal["none", "first", "first_last"]
CONDITIONS: tuple[str, ...] = ("none", "first", "first_last")


def condition_frames(condition: Condition) -> int:
    """Frames a clip is conditioned on: 0, 1 (``first``) or 2 (``first_last``)."""
    return CONDITIONS.index(condition)


def condition_pixels(pixels: torch.Tensor, condition: Condition) -> torch.Tensor:
    """The pixel clip the condition latent encodes: ``pixels [3, frames, h, w]`` with every frame but the first
    (``first_last``: and the last) set to zero, as the pipeline builds ``video_condition``."""
    padded = torch.zeros_like(pixels)
    padded[:, 0] = pixels[:, 0]
    if condition == "first_last":
        padded[:, -1] = pixels[:, -1]
    return padded


def condition_images(pixels: torch.Tensor, condition: Condition) -> list[Any]:
    """The conditioning frames of ``pixels [3, frames, h, w]`` in [-1, 1] as PIL RGB images (the pipeline takes
    PIL images; the pixels came from uint8 frames, so this gives those frames back exactly)."""
    from PIL import Image

    index = [0] if condition == "first" else [0, pixels.shape[1] - 1]
    images = []
    for i in index:
        frame = pixels[:, i].add(1.0).mul(127.5).round().clamp(0, 255).to(torch.uint8)
        images.append(Image.fromarray(frame.permute(1, 2, 0).numpy()))
    return images


def image_encoder_folders(path: str | Path) -> tuple[Path, Path]:
    """``(model folder, image processor folder)``: ``path/image_encoder`` + ``path/image_processor`` (a diffusers
    Wan I2V pipeline folder), or ``path`` itself holding the model's ``config.json`` and
    ``preprocessor_config.json``."""
    root = Path(path)
    for model, processor in ((root / "image_encoder", root / "image_processor"), (root, root)):
        if (model / "config.json").is_file() and (processor / "preprocessor_config.json").is_file():
            return model, processor
    if not root.exists():
        raise LoongError(f"--image-encoder: {root} does not exist")
    raise LoongError(f"--image-encoder: {root} holds no CLIP image encoder (expected image_encoder/ and "
                     "image_processor/ folders, as in a diffusers Wan I2V pipeline such as "
                     "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers, or one folder with config.json and "
                     "preprocessor_config.json)")


class ImageEncoder:
    """A transformers ``CLIPVisionModel`` and its image processor, on ``device`` in ``dtype``, eval mode, no grad."""

    def __init__(self, path: str | Path, device: str = "auto", dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoImageProcessor, CLIPVisionModel

        model_dir, processor_dir = image_encoder_folders(path)
        self.device = cli_device(device)
        try:
            # without torchvision, transformers gives the PIL-backed CLIP processor: the same steps, on PIL images
            self.processor = AutoImageProcessor.from_pretrained(processor_dir, local_files_only=True)
            self.model = CLIPVisionModel.from_pretrained(model_dir, torch_dtype=dtype,
                                                         local_files_only=True).to(self.device).eval()
        except Exception as exc:  # transformers raises many types for unreadable folders
            raise LoongError(f"--image-encoder: cannot load {model_dir} / {processor_dir}: {exc}") from None
        cfg = self.model.config
        if cfg.num_hidden_layers < 2:
            raise LoongError(f"--image-encoder: {model_dir} has {cfg.num_hidden_layers} layer; Wan takes the "
                             "penultimate hidden state, so it needs at least 2")
        #: CLIP tokens per image (the class token and one per patch) and their width
        self.tokens: int = (int(cfg.image_size) // int(cfg.patch_size)) ** 2 + 1
        self.dim: int = int(cfg.hidden_size)
        self.fingerprint: dict[str, Any] = {
            "path": str(model_dir), "config_sha256": _digest(model_dir / "config.json"),
            "processor_sha256": _digest(processor_dir / "preprocessor_config.json"),
        }

    @torch.no_grad()
    def encode(self, images: list[Any]) -> torch.Tensor:
        """PIL images → their penultimate-layer CLIP features, tokens joined: ``[len(images) · tokens, dim]``
        (float32, CPU)."""
        inputs = self.processor(images=images, return_tensors="pt")
        pixels = inputs["pixel_values"].to(self.device, self.model.dtype)
        hidden = self.model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        if hidden.shape[1:] != (self.tokens, self.dim):
            raise LoongError(f"--image-encoder: the image processor gives {hidden.shape[1]} tokens, the model's "
                             f"config {self.tokens} (image_size / patch_size); use the processor saved with it")
        return hidden.reshape(-1, self.dim).float().cpu().contiguous()


__all__ = ["CONDITIONS", "Condition", "ImageEncoder", "condition_frames", "condition_images", "condition_pixels",
           "image_encoder_folders"]
