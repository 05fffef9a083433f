"""Every vision encoder family sharded over a 2-rank group equals its unsharded self: imported by
``vlm_layouts.py`` (inside its 2-process gloo launch, no extra launch), not run on its own.

For each tiny encoder preset (Qwen2.5-VL's windowed ViT, Qwen3-VL's ViT with DeepStack taps, InternViT, SigLIP2)
the same seeded weights run unsharded on every rank and sharded by
:func:`~loong.vlm.models.vision.tensor_parallel.shard_vision_encoder` over the world group; the loss (a fixed
random projection of the final features and every intermediate) and every parameter's gradient, shards gathered
whole along their partition axis, are compared (fp32).
"""

from __future__ import annotations

import copy
from importlib.resources import files

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from loong.core.config.schema import from_dict
from loong.vlm.models.config import EncoderConfig
from loong.vlm.models.families import vision_family
from loong.vlm.models.vision.tensor_parallel import shard_vision_encoder

PRESETS = ("qwen2_5_vit_tiny", "qwen3_vit_tiny", "intern_vit_tiny", "siglip2_tiny")


def _config(preset: str) -> EncoderConfig:
    text = (files("loong.vlm.configs") / "encoder" / f"{preset}.yaml").read_text()
    return from_dict(EncoderConfig, OmegaConf.to_container(OmegaConf.create(text)))


def _inputs(cfg: EncoderConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pixels (and grid) of two media of different shapes (a video of two frames for the Qwen ViTs)."""
    if cfg.family == "intern_vit":
        return torch.randn(3, cfg.in_channels, cfg.image_size, cfg.image_size, generator=gen), None
    if cfg.family == "siglip2":
        grid = torch.tensor([[1, 4, 6], [1, 3, 5]])
        return torch.randn(int(grid.prod(-1).sum()), cfg.in_channels * cfg.patch_size ** 2, generator=gen), grid
    grid = torch.tensor([[1, 8, 8], [2, 4, 6]])
    dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    return torch.randn(int(grid.prod(-1).sum()), dim, generator=gen), grid


def _loss_and_grads(encoder: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor | None,
                    weights: list[torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """``sum(w * h)`` over the final features and the intermediates, and every parameter's whole gradient."""
    encoder.zero_grad()
    out = encoder(pixels, grid)
    features = [out.hidden, *out.intermediates]
    loss = sum((w[: f.shape[0]] * f).sum() for w, f in zip(weights, features, strict=False))
    loss.backward()
    grads = {}
    for name, p in encoder.named_parameters():
        g = p.grad.detach()
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, g.contiguous())
            g = torch.cat(parts, dim=p.partition_dim)
        grads[name] = g
    return float(loss.detach()), grads


def encoder_tp_parity() -> dict[str, dict[str, float]]:
    """Per preset: the loss's relative error and the largest gradient relative error (sharded over the world
    group vs unsharded), the number of sharded parameters, and whether the gradient keys agree."""
    out = {}
    for preset in PRESETS:
        cfg = _config(preset)
        family = vision_family(cfg.family).load()
        torch.manual_seed(0)
        whole = family.build_encoder(cfg)
        gen = torch.Generator().manual_seed(1)
        pixels, grid = _inputs(cfg, gen)
        weights = [torch.randn(4096, cfg.hidden_size, generator=gen) for _ in range(4)]
        ref_loss, ref = _loss_and_grads(whole, pixels, grid, weights)
        sharded = shard_vision_encoder(copy.deepcopy(whole), dist.group.WORLD)
        loss, got = _loss_and_grads(sharded, pixels, grid, weights)
        out[preset] = {
            "loss_err": abs(loss - ref_loss) / abs(ref_loss),
            "grad_err": max(float((got[k] - g).abs().max() / g.abs().max().clamp(min=1e-12)) for k, g in ref.items()),
            "sharded": float(sum(getattr(p, "tensor_model_parallel", False) for p in sharded.parameters())),
            "keys_equal": float(sorted(got) == sorted(ref)),
        }
    return out


__all__ = ["PRESETS", "encoder_tp_parity"]
