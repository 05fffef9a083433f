"""The frozen encoders of preprocessing: diffusers' ``AutoencoderKLWan`` and transformers' ``UMT5EncoderModel`` with
its tokenizer, from local folders (never downloaded).

Latents are the mean of the VAE's latent distribution, normalised as Wan trains on them (and as ``WanPipeline``
undoes before decoding): ``(z − latents_mean) / latents_std`` per channel, from the VAE's config. Text embeddings
are computed as ``WanPipeline`` computes them (its prompt cleaning, ``</s>`` appended, at most ``text_len``
tokens, the attention mask over the real tokens) and stored trimmed to the prompt's real length; the reader pads
them with zeros to ``data.text_len``, as the pipeline does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from loong.core.errors import LoongError
from loong.diffusion.devices import cli_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _config(folder: Path) -> dict[str, Any]:
    """A model folder's config.json ({} when it is not valid JSON: then the folder is no model folder)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def _digest(*files: Path) -> str:
    """A short hash of files' bytes (configs and tokenizer files: what decides what the encoders compute, along
    with the weights, which are too large to hash on every run)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def vae_folder(path: str | Path) -> Path:
    """``path`` if it holds an ``AutoencoderKLWan`` config, or its ``vae/`` (a diffusers pipeline folder)."""
    root = Path(path)
    for folder in (root, root / "vae"):
        if (folder / "config.json").is_file() and _config(folder).get("_class_name") == "AutoencoderKLWan":
            return folder
    if not root.exists():
        raise LoongError(f"--vae: {root} does not exist")
    raise LoongError(f"--vae: {root} holds no AutoencoderKLWan (expected config.json with _class_name "
                     "AutoencoderKLWan there or in its vae/ folder, e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers)")


def text_encoder_folders(path: str | Path) -> tuple[Path, Path]:
    """``(model folder, tokenizer folder)``: ``path/text_encoder`` + ``path/tokenizer`` (a diffusers pipeline folder),
    or ``path`` itself holding both the model's ``config.json`` and the tokenizer files."""
    root = Path(path)
    if (root / "text_encoder" / "config.json").is_file() and (root / "tokenizer").is_dir():
        return root / "text_encoder", root / "tokenizer"
    if (root / "config.json").is_file() and (root / "tokenizer_config.json").is_file():
        return root, root
    if not root.exists():
        raise LoongError(f"--text-encoder: {root} does not exist")
    raise LoongError(f"--text-encoder: {root} holds no text encoder (expected text_encoder/ and tokenizer/ "
                     "folders, as in a diffusers Wan pipeline, or one folder with config.json and "
                     "tokenizer_config.json)")


class Encoders:
    """The VAE and the text encoder on ``device`` in ``dtype`` (``fp32`` | ``bf16``), in eval mode, no grad."""

    def __init__(self, vae: str | Path, text_encoder: str | Path, device: str = "auto", dtype: str = "fp32",
                 text_len: int = 512) -> None:
        from diffusers import AutoencoderKLWan
        from transformers import AutoTokenizer, UMT5EncoderModel

        if dtype not in DTYPES:
            raise LoongError(f"--dtype: {dtype!r} is not one of {sorted(DTYPES)}")
        if text_len < 1:
            raise LoongError(f"--text-len must be >= 1, got {text_len}")
        self.device, self.dtype, self.text_len = cli_device(device), DTYPES[dtype], text_len
        vae_dir = vae_folder(vae)
        model_dir, tok_dir = text_encoder_folders(text_encoder)
        try:
            self.vae = AutoencoderKLWan.from_pretrained(vae_dir, torch_dtype=self.dtype).to(self.device).eval()
        except Exception as exc:  # diffusers raises many types for unreadable folders
            raise LoongError(f"--vae: cannot load {vae_dir}: {exc}") from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
            self.text_encoder = UMT5EncoderModel.from_pretrained(model_dir, torch_dtype=self.dtype,
                                                                 local_files_only=True).to(self.device).eval()
        except Exception as exc:  # transformers raises many types for unreadable folders
            raise LoongError(f"--text-encoder: cannot load {model_dir} / {tok_dir}: {exc}") from None
        cfg = self.vae.config
        self.latent_channels: int = int(cfg.z_dim)
        self.temporal: int = int(cfg.scale_factor_temporal or 4)
        self.spatial: int = int(cfg.scale_factor_spatial or 8)
        self.text_dim: int = int(self.text_encoder.config.d_model)
        shape = (1, self.latent_channels, 1, 1, 1)
        self._mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(shape)
        self._std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(shape)
        tok_files = sorted(p for p in tok_dir.iterdir() if p.is_file() and p.suffix in (".json", ".model", ".txt"))
        #: what the output depends on, compared when a run resumes into an existing folder
        self.fingerprint: dict[str, Any] = {
            "vae": {"path": str(vae_dir), "config_sha256": _digest(vae_dir / "config.json")},
            "text_encoder": {"path": str(model_dir), "config_sha256": _digest(model_dir / "config.json"),
                             "tokenizer_sha256": _digest(*tok_files)},
            "dtype": dtype, "text_len": text_len,
        }

    @torch.no_grad()
    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[3, frames, height, width]`` in [-1, 1] → normalised latents ``[c, f, h, w]`` (float32, CPU)."""
        x = pixels[None].to(self.device, self.dtype)
        z = self.vae.encode(x).latent_dist.mean.float().cpu()
        return ((z - self._mean) / self._std)[0].contiguous()

    @torch.no_grad()
    def encode_text(self, caption: str) -> torch.Tensor:
        """``caption`` → its UMT5 embeddings ``[tokens, text_dim]`` (float32, CPU), trimmed to its real length."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        inputs = self.tokenizer([prompt_clean(caption)], max_length=self.text_len, truncation=True,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = inputs.input_ids.to(self.device), inputs.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, mask).last_hidden_state
        return hidden[0, : int(mask.sum())].float().cpu().contiguous()


__all__ = ["DTYPES", "Encoders", "text_encoder_folders", "vae_folder"]
