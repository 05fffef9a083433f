"""The ``diffusion.wan`` task on one process: its samples, its loss against a hand-computed MSE, the layouts'
shared sample stream and ``model.init_from_diffusers``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from wan_testing import make_task

from loong.core.errors import LoongError
from loong.diffusion.models.wan import save_diffusers
from loong.diffusion.task import WanTask

SMALL = {"data": {"frames": 2, "height": 8, "width": 8, "num_clips": 8},
         "train": {"global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32"}}


def _task(dp: int = 1, dp_rank: int = 0, **sections: Any) -> WanTask:
    return make_task(SMALL, dp, dp_rank, **sections)


def test_loss_is_the_mse_of_the_models_prediction() -> None:
    task = _task(train={"timestep_sampling": "logit_normal", "timestep_shift": 3.0})
    torch.manual_seed(0)
    model = task.build_model()
    batch = next(task.train_microbatches(0, 2))
    loss, _ = task.loss(model, batch)
    # by hand: the whole prediction [b, c, F, H, W] of the bare model against the target
    pred = model.wan(batch["noisy"], batch["timestep"], batch["text"])
    assert pred.shape == batch["target"].shape == (2, 16, 2, 8, 8)
    torch.testing.assert_close(loss, ((pred - batch["target"]) ** 2).mean(), rtol=1e-6, atol=0)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_samples_are_the_synthetic_clips_under_flow_matching() -> None:
    task = _task()
    s = task.sample(11)
    clip = task.dataset.clip(11)
    sigma = s["timestep"] / 1000
    # x_t = x0 + σ·(ε − x0), so the clean latents are x_t − σ·target
    torch.testing.assert_close(s["noisy"] - sigma * s["target"], clip["latents"], rtol=0, atol=1e-6)
    assert torch.equal(s["text"], clip["text"]) or not s["text"].any()  # the text, or dropped to zeros
    assert all(torch.equal(s[k], task.sample(11)[k]) for k in s)


def test_data_parallel_ranks_split_the_same_global_batch() -> None:
    whole = next(_task().train_microbatches(3, 1))
    halves = [next(_task(dp=2, dp_rank=r).train_microbatches(3, 1)) for r in (0, 1)]
    for key in whole:
        assert torch.equal(torch.cat([h[key] for h in halves]), whole[key])


def test_per_token_timesteps_for_ti2v() -> None:
    task = _task(model={"preset": "tiny_ti2v"})
    batch = next(task.train_microbatches(0, 2))
    assert batch["timestep"].shape == (2, 2 * 4 * 4)
    loss, _ = task.loss(task.build_model(), batch)
    assert torch.isfinite(loss)


def test_init_from_diffusers(tmp_path: Path) -> None:
    source = _task().build_model().wan
    folder = save_diffusers(source.state_dict(), source.config, tmp_path / "transformer")
    task = _task(model={"init_from_diffusers": str(folder)})
    model = task.build_model()
    task.init_weights(model)
    for key, value in source.state_dict().items():
        assert torch.equal(model.wan.state_dict()[key], value), key
    other = _task(model={"init_from_diffusers": str(folder), "num_layers": 3})
    with pytest.raises(LoongError, match="model.init_from_diffusers: .*num_layers"):
        other.init_weights(other.build_model())


def test_config_checks_name_the_key() -> None:
    from loong.core.config.checks import check_paths
    from loong.core.config.schema import from_dict
    from loong.diffusion.schema import DiffusionRunConfig

    # paths must exist when a run starts (compose_config runs check_paths), not when a saved config is read back
    cfg = from_dict(DiffusionRunConfig, {"model": {"init_from_diffusers": "/nonexistent/wan"}})
    with pytest.raises(LoongError, match="model.init_from_diffusers=/nonexistent/wan: must be an existing folder"):
        check_paths(cfg)
    with pytest.raises(LoongError, match="data.height=7"):
        _task(data={"height": 7})
    with pytest.raises(LoongError, match="model.in_channels=20"):
        _task(model={"in_channels": 20})
    with pytest.raises(LoongError, match="unknown Wan preset 'tinny'"):
        _task(model={"preset": "tinny"})
    with pytest.raises(LoongError, match="train.timestep_shift"):
        _task(train={"timestep_shift": 0.0})
    with pytest.raises(LoongError, match="data.text_drop_prob"):
        _task(data={"text_drop_prob": -0.1})


def test_flops_per_token_counts_parameters_and_attention() -> None:
    task = _task()
    w = task.wan
    assert task.tokens_per_step() == 4 * 2 * 4 * 4
    assert task.flops_per_token() == 6 * w.num_parameters() + 12 * w.num_layers * w.dim * (32 + 8)
