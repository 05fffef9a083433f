"""Helpers of the Wan tests (also imported by the multi-process workers): tiny configs of each variant, random
weights and inputs, the diffusers call and the error measure."""

from __future__ import annotations

from pathlib import Path

import torch

#: diffusers' Wan cross-attention splits its context as "image tokens, then the last 512 text tokens" (a constant
#: in its attention processor), so an I2V comparison needs exactly 512 text tokens; Loong takes them separately
I2V_TEXT_TOKENS = 512


def tiny_config(variant: str):  # noqa: ANN201
    """The tiny :class:`WanConfig` of a variant: ``t2v``, ``i2v``, ``flf2v`` (I2V with the first-last-frame
    position table over two images of 5 tokens) or ``ti2v``."""
    from loong.diffusion.models.wan import PRESETS

    if variant == "flf2v":
        return PRESETS["tiny_i2v"].replace(pos_embed_seq_len=10)
    return PRESETS[{"t2v": "tiny", "i2v": "tiny_i2v", "ti2v": "tiny_ti2v"}[variant]]


def perturb(module: torch.nn.Module, seed: int) -> None:
    """Add noise to every parameter, so that no norm weight is 1 and no bias or position table 0 (a mapping that
    mixed two such tensors up would still pass with the default init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


def wan_inputs(config, seed: int = 1, batch: int = 2, frames: int = 3, height: int = 8,  # noqa: ANN001
               width: int = 6) -> dict[str, torch.Tensor | None]:
    """Random model inputs for ``config``: latents (3 x 8 x 6 → a 3 x 4 x 3 token grid, 36 tokens), a
    timestep per sample (or, TI2V, per token with the first latent frame's tokens at 0), text and image tokens."""
    g = torch.Generator().manual_seed(seed)
    pt, ph, pw = config.patch_size
    tokens = (frames // pt) * (height // ph) * (width // pw)
    latents = torch.randn(batch, config.in_channels, frames, height, width, generator=g)
    timestep = torch.tensor([999.0, 250.5, 600.0, 10.0][:batch])
    if config.expand_timesteps:
        # the TI2V pipeline's mask: 0 on the conditioning (first latent) frame, t elsewhere
        first_frame = tokens // (frames // pt)
        timestep = timestep[:, None].repeat(1, tokens)
        timestep[:, :first_frame] = 0.0
    text_tokens = I2V_TEXT_TOKENS if config.image_dim is not None else 7
    text = torch.randn(batch, text_tokens, config.text_dim, generator=g)
    image = None
    if config.image_dim is not None:
        images = 2 * batch if config.pos_embed_seq_len else batch  # first-last frame: two images a sample
        image = torch.randn(images, 5, config.image_dim, generator=g)
    return {"latents": latents, "timestep": timestep, "text": text, "image": image}


def run_diffusers(model, inputs: dict) -> torch.Tensor:  # noqa: ANN001
    """diffusers' prediction for :func:`wan_inputs`."""
    return model(inputs["latents"], inputs["timestep"], inputs["text"], encoder_hidden_states_image=inputs["image"],
                 return_dict=False)[0]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest absolute difference relative to the largest absolute reference value."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def make_task(base: dict, dp: int = 1, dp_rank: int = 0, **sections: dict):  # noqa: ANN201
    """A checked, data-ready ``diffusion.wan`` task on one process posing as DP rank ``dp_rank`` of ``dp``: the
    config sections of ``base`` updated key by key with ``sections`` (``model={...}``, ``data={...}``, ...)."""
    import types

    from loong.core.accelerators import select_accelerator
    from loong.core.attention import CPGroups
    from loong.core.config import from_dict
    from loong.diffusion.schema import DiffusionRunConfig
    from loong.diffusion.task import WanTask

    plain = {key: {**base.get(key, {}), **sections.get(key, {})} for key in {*base, *sections}}
    cfg = from_dict(DiffusionRunConfig, plain)
    WanTask.check_config(cfg)
    task = WanTask(cfg, select_accelerator(), types.SimpleNamespace(dp=dp, dp_rank=dp_rank, cp_groups=CPGroups()))
    task.setup_data()
    return task


def worker_env() -> dict[str, str]:
    """This environment without the distributed variables a test process may carry (an in-process run's port,
    the single-process flag), which relaunched workers must not inherit."""
    import os

    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "LOONG_SINGLE_PROCESS")
    return {k: v for k, v in os.environ.items() if k not in drop}


def torchrun_report(worker: str, out: Path, nproc: int = 2) -> dict:
    """Run ``workers/<worker>`` on ``nproc`` gloo processes (``torch.distributed.run --standalone``), which writes
    its JSON report to ``out``; return the report (the workers' stderr tail on failure)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(Path(__file__).parent / "workers" / worker), str(out)],
                          capture_output=True, text=True, timeout=600, env=worker_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def train_losses(run_dir: Path) -> list[float]:
    """The training losses a run logged, step by step (``metrics.jsonl``)."""
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["train_loss"] for r in map(json.loads, lines) if "train_loss" in r]
