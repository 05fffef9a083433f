"""Image-to-video conditioning of training samples against diffusers' Wan image-to-video pipeline: the frame mask,
the condition latent, the TI2V first-frame replacement and per-token timesteps, and the task's samples and loss."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_components import tiny_vae_folder
from wan_testing import make_task

from loong.core.attention import CPGroups
from loong.core.errors import LoongError
from loong.diffusion.conditioning import (
    channel_input,
    condition_latent,
    frame_mask,
    latent_input,
    weighted_mse,
)
from loong.diffusion.models.wan.config import wan_preset
from loong.diffusion.task import WanTask, to_tokens

SMALL = {"data": {"frames": 3, "height": 8, "width": 8, "num_clips": 8, "image_len": 5},
         "train": {"global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32"}}


def _task(**sections: Any) -> WanTask:
    return make_task(SMALL, **sections)


def _pipeline_latents(vae_dir: Path, image: torch.Tensor, frames: int, expand: bool, last: torch.Tensor | None):
    """diffusers' ``WanImageToVideoPipeline.prepare_latents`` on the tiny VAE (the oracle), unbound: it reads only
    the VAE, the two scale factors and ``config.expand_timesteps`` from the pipeline."""
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline

    vae = AutoencoderKLWan.from_pretrained(vae_dir).eval()
    pipe = types.SimpleNamespace(vae=vae, vae_scale_factor_temporal=4, vae_scale_factor_spatial=8,
                                 config=types.SimpleNamespace(expand_timesteps=expand))
    h, w = image.shape[-2:]
    with torch.no_grad():
        return vae, WanImageToVideoPipeline.prepare_latents(pipe, image, 1, 16, h, w, frames, torch.float32,
                                                            torch.device("cpu"), torch.Generator().manual_seed(0),
                                                            last_image=last)


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_vae_folder(tmp_path_factory.mktemp("vae"))


@pytest.mark.parametrize("last", [False, True], ids=["i2v", "flf2v"])
def test_frame_mask_and_condition_equal_the_pipelines(vae_dir: Path, last: bool) -> None:
    g = torch.Generator().manual_seed(1)
    image = torch.rand(1, 3, 32, 32, generator=g) * 2 - 1
    last_image = torch.rand(1, 3, 32, 32, generator=g) * 2 - 1 if last else None
    vae, (noise, condition) = _pipeline_latents(vae_dir, image, 9, False, last_image)
    mask, latent_condition = condition[0, :4], condition[0, 4:]
    assert torch.equal(frame_mask(3, 4, 4, last=last), mask)
    # the VAE is causal in time: the padded clip's first latent frame is the image's own latent
    mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    with torch.no_grad():
        alone = (vae.encode(image.unsqueeze(2)).latent_dist.mode()[0] - mean) / std
    torch.testing.assert_close(latent_condition[:, :1], alone, rtol=1e-5, atol=1e-5)
    # the training input: the noisy clip, the mask, the condition (here the pipeline's own) in the pipeline's order
    clip = torch.randn(16, 3, 4, 4, generator=g)
    assert torch.equal(condition_latent(clip, latent_condition, last=last), latent_condition)
    standin = condition_latent(clip, last=last)  # without a VAE: the clip's first (and last) frame, zeros between
    assert torch.equal(standin[:, 0], clip[:, 0]) and not standin[:, 1].any()
    assert torch.equal(standin[:, 2], clip[:, 2] if last else torch.zeros_like(clip[:, 2]))
    assert torch.equal(channel_input(noise[0], latent_condition, last=last), torch.cat([noise[0], condition[0]]))


def test_ti2v_first_frame_replacement_and_timesteps_equal_the_pipelines(vae_dir: Path) -> None:
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    _, (noise, cond, first_frame_mask) = _pipeline_latents(vae_dir, image, 9, True, None)
    wan = wan_preset("tiny_ti2v").replace(in_channels=16, out_channels=16)
    t = torch.tensor(700.0)
    clip = torch.randn(16, 3, 4, 4, generator=torch.Generator().manual_seed(3))
    clip[:, :1] = cond[0]  # the clip's first latent frame is the image's latent (causal VAE)
    x, per_token, weight = latent_input(noise[0], clip, t, wan)
    # WanImageToVideoPipeline.__call__ with expand_timesteps: the model input and its per-token timesteps
    assert torch.equal(x, ((1 - first_frame_mask) * cond + first_frame_mask * noise)[0])
    assert torch.equal(per_token, (first_frame_mask[0][0][:, ::2, ::2] * t).flatten())
    assert torch.equal(weight, first_frame_mask[0][0][:, ::2, ::2].flatten())


def test_weighted_mse_is_the_mean_over_weighted_tokens() -> None:
    g = torch.Generator().manual_seed(4)
    pred, target = torch.randn(2, 6, 5, generator=g), torch.randn(2, 6, 5, generator=g)
    weight = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.float32)
    err = (pred - target).pow(2).mean(-1)
    want = err[weight.bool()].mean()
    torch.testing.assert_close(weighted_mse(pred, target, weight, CPGroups()), want)


def test_i2v_samples_feed_the_model_its_channels_and_image_tokens() -> None:
    task = _task(model={"preset": "tiny_i2v"})
    batch = next(task.train_microbatches(0, 2))
    wan = task.wan
    assert batch["noisy"].shape == (2, wan.in_channels, 3, 8, 8)
    assert batch["image"].shape == (2, 5, wan.image_dim)
    clean = task.dataset.clip(0)["latents"]
    # channels 16..19: the mask (first latent frame only); 20..35: the first latent frame, then zeros
    assert torch.equal(batch["noisy"][0, 16:20], frame_mask(3, 8, 8))
    assert torch.equal(batch["noisy"][0, 20:, 0], clean[:, 0])
    assert not batch["noisy"][0, 20:, 1:].any()
    model = task.build_model()
    loss, _ = task.loss(model, batch)
    pred = model(batch["noisy"], batch["timestep"], batch["text"], batch["image"])
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(pred, to_tokens(batch["target"], wan)))


def test_ti2v_samples_condition_some_clips_and_leave_their_first_frame_out_of_the_loss() -> None:
    task = _task(model={"preset": "tiny_ti2v"}, data={"image_cond_prob": 0.5})
    samples = [task.sample(i) for i in range(32)]
    first = 4 * 4  # tokens of one latent frame (8×8 latent, 2×2 patches)
    conditioned = [s for s in samples if not s["weight"][:first].any()]
    assert 6 <= len(conditioned) <= 26  # about half of 32 (seeded, so fixed)
    for i, s in enumerate(samples):
        clean = task.dataset.clip(i)["latents"]
        if s["weight"][:first].any():  # text-to-video: everything noised, one timestep, every token in the loss
            assert s["weight"].all() and (s["timestep"] == s["timestep"][0]).all()
        else:
            assert torch.equal(s["noisy"][:, 0], clean[:, 0]) and not s["timestep"][:first].any()
    model = task.build_model()
    batch = next(task.train_microbatches(0, 1))
    loss, _ = task.loss(model, batch)
    pred = model(batch["noisy"], batch["timestep"], batch["text"])
    err = (pred - to_tokens(batch["target"], task.wan)).pow(2).mean(-1)
    torch.testing.assert_close(loss, err[batch["weight"].bool()].mean())


@pytest.mark.parametrize(("sections", "message"), [
    ({"model": {"preset": "wan2_1_flf2v_14b", "num_layers": 1}, "data": {"image_len": 5}},
     "set data.image_len=257"),
    ({"model": {"preset": "tiny", "in_channels": 20}}, "2·out_channels + 4 = 36"),
])
def test_conditioning_that_cannot_work_is_refused(sections: dict, message: str) -> None:
    with pytest.raises(LoongError, match=re.escape(message)):
        _task(**sections)
