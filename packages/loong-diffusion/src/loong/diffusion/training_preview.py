"""``train.preview_interval``: during training, a GIF of clips denoised by the weights being trained,
``<run>/previews/step_N.gif`` beside the loss plot.

Every ``preview_interval`` steps each rank denoises the same clips with the same noise (seeded by ``train.seed``,
so the previews of one run differ only by the weights): the first eight classes of the synthetic set (exactly what
``loong-diffusion sample RUN --seed <train.seed> --steps <preview_steps> --guidance <preview_guidance>`` draws), or
with ``data.source=shards`` the captions of the first eight clips of the first clip's bucket, at that bucket's
size. The unconditional text of the guidance is zeros, as text dropout trains it. It runs on the sharded module
the engine trains: under FSDP2 its root is gathered once (``unshard``), each block gathers itself as in a
forward; under context parallelism every rank predicts its shard of the tokens and the shards are gathered;
bf16 runs predict under autocast. The logging rank writes the latents as colours (:mod:`.preview`). A preview
costs ``2 × train.preview_steps`` forward passes of those clips (classifier-free guidance with
``train.preview_guidance`` > 1; one pass a step without).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loong.core.engines.base import resolve_dtype
from loong.core.errors import LoongError
from loong.diffusion.flow import NUM_TRAIN_TIMESTEPS
from loong.diffusion.models.wan import WanConfig, WanTransformer
from loong.diffusion.models.wan.parallel import gather_shards
from loong.diffusion.preview import latent_colours, tile, write_gif
from loong.diffusion.sampling import denoise, flow_scheduler

#: at most this many classes side by side in a preview
MAX_CLIPS = 8


def check_preview(cfg: Any, wan: WanConfig) -> None:
    """Refuse ``train.preview_interval`` where a preview cannot be drawn, naming why (before anything runs)."""
    if cfg.train.preview_interval and (wan.image_dim is not None or wan.in_channels != wan.out_channels):
        raise LoongError(f"train.preview_interval={cfg.train.preview_interval}: previews generate text-to-video; "
                         f"model.preset={cfg.model.preset} takes an image condition (set train.preview_interval=0)")


def _conditions(task: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The preview clips' text features ``[n, text_len, text_dim]`` and their latent size (see the docstring)."""
    data = task.dataset
    if task.cfg.data.source == "shards":
        bucket = data.records[0].bucket
        picks = [i for i, r in enumerate(data.records) if r.bucket == bucket][:MAX_CLIPS]
        return torch.stack([data.clip(i)["text"] for i in picks]), tuple(data.latent_shapes[bucket][1:])
    labels = range(min(task.cfg.data.num_classes, MAX_CLIPS))
    return torch.stack([data.text(label) for label in labels]), task.cfg.data.latent_sizes()[0]


def _transformers(module: nn.Module) -> list[WanTransformer]:
    """The Wan model(s) inside the trained module: one (of a one-expert A14B run too: it denoises every step, as
    ``sample`` uses it), or the high- and the low-noise expert."""
    if hasattr(module, "wan"):
        return [module.wan]
    return [module.high_noise.wan, module.low_noise.wan]


def write_preview(task: Any, module: nn.Module, step: int) -> Path | None:
    """Collective (every rank runs it): denoise the preview clips with ``module`` (the trained module, wrapped as the
    engine trains it) and write ``<run>/previews/step_<step>.gif`` on the logging rank; returns its path there."""
    cfg, wan, layout = task.cfg, task.wan, task.layout
    t = cfg.train
    device = task.accelerator.device(layout.local_rank)
    dtype = resolve_dtype(t.precision, task.accelerator)
    models = _transformers(module)
    boundary = wan.boundary_ratio * NUM_TRAIN_TIMESTEPS if len(models) == 2 else None
    groups = layout.cp_groups

    def predict(latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        model = models[1] if boundary is not None and float(timestep.flatten()[-1]) < boundary else models[0]
        tokens = gather_shards(model.forward_shard(latents, timestep, text), groups, dim=1)
        return model.unpatchify(tokens, model.grid(latents)).float()

    text, size = _conditions(task)
    text = text.to(device)
    noise = torch.randn(text.shape[0], wan.out_channels, *size, generator=torch.Generator().manual_seed(t.seed))
    tokens = None
    if wan.expand_timesteps:
        tokens = (size[0] // wan.patch_size[0]) * (size[1] // wan.patch_size[1]) * (size[2] // wan.patch_size[2])
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())
    fsdp = hasattr(module, "unshard")  # FSDP2's root: its own parameters gathered for the whole preview
    if fsdp:
        module.unshard()
    try:
        with autocast:
            latents = denoise(predict, noise.to(device), text, torch.zeros_like(text),
                              scheduler=flow_scheduler("unipc", t.timestep_shift), steps=t.preview_steps,
                              guidance=t.preview_guidance, tokens=tokens)
    finally:
        if fsdp:
            module.reshard()
    if not layout.is_logging_rank or task.run_dir is None:
        return None
    return write_gif(tile(latent_colours(latents)), Path(task.run_dir) / "previews" / f"step_{step:08d}.gif")


__all__ = ["MAX_CLIPS", "check_preview", "write_preview"]
