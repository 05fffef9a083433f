"""Generation with a Wan model: diffusers' flow-matching schedulers with Wan's shift, classifier-free guidance,
the VAE decode of ``WanPipeline``.

The denoising loop is ``WanPipeline``'s: start from Gaussian noise (float32), at each of the scheduler's timesteps
predict the flow ``v`` for the text (and, with guidance > 1, for the negative text), combine them as
``v_neg + guidance·(v − v_neg)`` and let the scheduler step. The model is any ``predict(latents, timestep, text)``
(Loong's ``WanTransformer``, or its sharded training module in a preview), so the same loop serves
``loong-diffusion sample`` and ``train.preview_interval``. Schedulers are diffusers' own:
``UniPCMultistepScheduler`` with flow sigmas (the Wan pipelines' default) or ``FlowMatchEulerDiscreteScheduler``,
both shifted by σ' = shift·σ / (1 + (shift − 1)·σ) like the training timesteps (``train.timestep_shift``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from loong.core.errors import LoongError
from loong.diffusion.flow import NUM_TRAIN_TIMESTEPS

#: the denoising schedulers ``--scheduler`` names: diffusers' multistep UniPC (Wan's default) and plain Euler
SCHEDULERS = ("unipc", "euler")

#: ``predict(latents [b, c, F, H, W] float32, timestep [b] or [b, tokens], text [b, s, d]) -> flow, latents' shape``
Predict = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def flow_scheduler(kind: str, shift: float) -> Any:
    """A fresh diffusers scheduler for Wan's flow matching: ``unipc`` (``UniPCMultistepScheduler``, flow sigmas and
    prediction, as Wan's diffusers pipelines ship it) or ``euler`` (``FlowMatchEulerDiscreteScheduler``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if shift <= 0:
        raise LoongError(f"--shift must be > 0 (1: no shift; Wan samples 480p at 3, 720p at 5), got {shift}")
    if kind == "unipc":
        return UniPCMultistepScheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS, prediction_type="flow_prediction",
                                       use_flow_sigmas=True, flow_shift=shift)
    if kind == "euler":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=shift)
    raise LoongError(f"--scheduler: {kind!r} is not one of {', '.join(SCHEDULERS)}")


def _progress(enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("[bold]sample"), BarColumn(), MofNCompleteColumn(), TextColumn("t={task.fields[t]}"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=not enabled, transient=False)


@torch.no_grad()
def denoise(predict: Predict, noise: torch.Tensor, text: torch.Tensor, negative: torch.Tensor | None, *,
            scheduler: Any, steps: int, guidance: float, tokens: int | None = None,
            progress: bool = False) -> torch.Tensor:
    """The latents ``steps`` scheduler steps from ``noise`` ``[b, c, F, H, W]`` (float32), conditioned on ``text``
    ``[b, s, d]``; ``negative`` (same shape) is the guidance's other condition, used when ``guidance`` > 1.
    ``tokens``: the model takes a timestep per video token (Wan 2.2 TI2V), ``[b, tokens]``, every one at t."""
    if steps < 1:
        raise LoongError(f"--steps must be >= 1, got {steps}")
    guided = guidance > 1.0
    if guided and negative is None:
        raise LoongError("guidance > 1 needs a negative (unconditional) text condition")
    scheduler.set_timesteps(steps, device=noise.device)
    latents = noise.float()
    with _progress(progress) as bar:
        task = bar.add_task("sample", total=len(scheduler.timesteps), t="-")
        for t in scheduler.timesteps:
            timestep = t.float().expand(latents.shape[0])
            if tokens is not None:
                timestep = timestep[:, None].expand(-1, tokens)
            flow = predict(latents, timestep, text).float()
            if guided:
                unconditional = predict(latents, timestep, negative).float()
                flow = unconditional + guidance * (flow - unconditional)
            latents = scheduler.step(flow, t, latents, return_dict=False)[0]
            bar.update(task, advance=1, t=f"{float(t):.0f}")
    return latents


class ModelPredict:
    """``predict`` for a whole-sequence Wan model (``WanTransformer``): inputs cast to ``dtype``, flow back in fp32.

    With ``low_noise`` (Wan 2.2 A14B) ``model`` is the high-noise expert: it predicts at timesteps
    ``>= boundary_timestep`` and ``low_noise`` below, as ``WanPipeline`` switches ``transformer`` / ``transformer_2``.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, low_noise: torch.nn.Module | None = None,
                 boundary_timestep: float | None = None) -> None:
        if (low_noise is None) != (boundary_timestep is None):
            raise ValueError("low_noise and boundary_timestep go together")
        self.model, self.dtype, self.low_noise, self.boundary = model, dtype, low_noise, boundary_timestep

    def __call__(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        model = self.model
        if self.low_noise is not None and float(timestep.flatten()[-1]) < self.boundary:
            model = self.low_noise  # the step's t (per-token timesteps all equal it here)
        return model(latents.to(self.dtype), timestep, text.to(self.dtype)).float()


def pad_text(embeddings: torch.Tensor, length: int) -> torch.Tensor:
    """One prompt's text features ``[tokens, d]`` zero-padded (or cut) to ``[length, d]``, as ``WanPipeline`` pads
    UMT5's output to its 512 tokens and the training shards are padded to ``data.text_len``."""
    out = embeddings.new_zeros(length, embeddings.shape[-1])
    n = min(length, embeddings.shape[0])
    out[:n] = embeddings[:n]
    return out


@torch.no_grad()
def decode(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents ``[b, z, F, H, W]`` → frames ``[b, frames, height, width, 3]`` in [0, 1] (float32, CPU):
    ``WanPipeline``'s decode (the VAE config's ``latents_mean`` / ``latents_std`` undone, then ``vae.decode``)."""
    cfg = vae.config
    device = next(vae.parameters()).device
    shape = (1, cfg.z_dim, 1, 1, 1)
    mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(shape).to(device)
    std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(shape).to(device)
    z = (latents.to(device).float() * std + mean).to(vae.dtype)
    video = vae.decode(z, return_dict=False)[0]  # [b, 3, frames, height, width] in [-1, 1]
    return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).cpu()


__all__ = ["SCHEDULERS", "ModelPredict", "Predict", "decode", "denoise", "flow_scheduler", "pad_text"]
