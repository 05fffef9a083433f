"""Wan 2.2 A14B's two experts in training: each expert's timestep range (the full distribution conditioned on it),
the per-step expert of ``model.expert=both``, its routing and gradients, and the layouts that refuse it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from wan_testing import make_task, train_losses, worker_env

from loong.core.errors import LoongError
from loong.diffusion.cli import main
from loong.diffusion.experts import ExpertPair, expert_range, step_expert
from loong.diffusion.flow import sample_sigma, sigma_mass
from loong.diffusion.models.wan.config import wan_preset
from loong.diffusion.task import WanTask, to_tokens

SMALL = {"model": {"preset": "tiny_a14b"}, "data": {"frames": 2, "height": 8, "width": 8, "num_clips": 8},
         "train": {"global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32", "timestep_shift": 5.0}}
DRAWS = 4000


def _task(**sections: Any) -> WanTask:
    return make_task(SMALL, **sections)


def _draws(sampling: str, shift: float, sigma_range: tuple[float, float], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([sample_sigma(g, sampling, shift, 0.3, 0.8, sigma_range) for _ in range(DRAWS)]).double()


@pytest.mark.parametrize(("sampling", "shift"), [("uniform", 5.0), ("logit_normal", 3.0)])
def test_an_experts_draw_is_the_full_distribution_conditioned_on_its_range(sampling: str, shift: float) -> None:
    full = _draws(sampling, shift, (0.0, 1.0), seed=0)
    for sigma_range in ((0.875, 1.0), (0.0, 0.875)):
        ranged = _draws(sampling, shift, sigma_range, seed=1)
        lo, hi = sigma_range
        assert ranged.min() >= lo and ranged.max() <= hi
        inside = full[(full >= lo) & (full <= hi)]
        # two-sample Kolmogorov-Smirnov distance on a grid of the range (a wrong conditional is off by > 0.2)
        grid = torch.linspace(lo, hi, 101, dtype=torch.float64)
        ks = ((ranged[:, None] <= grid).double().mean(0) - (inside[:, None] <= grid).double().mean(0)).abs().max()
        assert ks < 0.06, (sigma_range, float(ks))
        share = float(((full >= lo) & (full <= hi)).double().mean())
        assert sigma_mass(sampling, shift, 0.3, 0.8, sigma_range) == pytest.approx(share, abs=0.03)


def test_one_expert_trains_on_its_timesteps_only() -> None:
    for expert, inside in (("high_noise", lambda t: t >= 875), ("low_noise", lambda t: t <= 875)):
        task = _task(model={"expert": expert})
        timesteps = torch.cat([b["timestep"] for s in range(6) for b in task.train_microbatches(s, 2)])
        assert inside(timesteps).all(), (expert, timesteps)
        assert isinstance(task.build_model(), torch.nn.Module) and not isinstance(task.build_model(), ExpertPair)


def test_both_experts_take_steps_in_proportion_and_each_step_routes_to_one() -> None:
    wan, train = wan_preset("tiny_a14b"), _task().cfg.train
    experts = [step_expert(wan, train, s) for s in range(2000)]
    high = sigma_mass("uniform", 5.0, 0.0, 1.0, expert_range(wan, "high_noise"))
    assert experts.count("high_noise") / 2000 == pytest.approx(high, abs=0.04)
    assert experts == [step_expert(wan, train, s) for s in range(2000)]  # a pure function of (seed, step)

    task = _task()
    torch.manual_seed(0)
    model = task.build_model()
    assert isinstance(model, ExpertPair) and len(task.blocks(model)) == 2 * wan.num_layers
    for step in range(4):
        expert = step_expert(wan, task.cfg.train, step)
        lo, hi = (1000 * x for x in expert_range(wan, expert))
        for batch in task.train_microbatches(step, 2):
            assert batch["expert"] == expert and ((batch["timestep"] >= lo) & (batch["timestep"] <= hi)).all()
            loss, _ = task.loss(model, batch)
            alone = getattr(model, expert)(batch["noisy"], batch["timestep"], batch["text"])
            torch.testing.assert_close(loss, torch.nn.functional.mse_loss(alone, to_tokens(batch["target"], wan)))
            loss.backward()
            other = "low_noise" if expert == "high_noise" else "high_noise"
            assert all(p.grad is None for p in getattr(model, other).parameters())
            assert all(p.grad is not None for p in getattr(model, expert).parameters())
            model.zero_grad(set_to_none=True)


@pytest.mark.parametrize(("sections", "message"), [
    ({"model": {"preset": "tiny", "expert": "high_noise"}}, "has one expert"),
    ({"parallel": {"fsdp": "none"}}, "which DDP (parallel.fsdp=none) refuses"),
    ({"data": {"pack_tokens": 64}}, "with model.expert=both"),
])
def test_expert_settings_that_cannot_work_are_refused(sections: dict, message: str) -> None:
    with pytest.raises(LoongError, match=re.escape(message)):
        _task(**sections)


@pytest.mark.slow
def test_both_experts_under_fsdp_over_two_ranks_train_as_one_process(tmp_path: Path) -> None:
    """Steps that leave one expert unused keep two FSDP2 ranks in lockstep and give one process's losses."""
    common = ["model=tiny_a14b", "train.steps=4", "train.progress=false", "train.eval_interval=0",
              "train.save_final=false", "train.timestep_shift=5", "train.micro_batch_size=4"]
    assert main(["train", *common, f"output_dir={tmp_path}", "run_name=one"]) == 0
    env = worker_env()
    proc = subprocess.run([sys.executable, "-m", "loong.diffusion.cli", "train", "--nproc-per-node", "2", *common,
                           "parallel.dp_shard=2", f"output_dir={tmp_path}", "run_name=dp2"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


    experts = {step_expert(wan_preset("tiny_a14b"), _task().cfg.train, s) for s in range(4)}
    assert experts == {"high_noise", "low_noise"}  # the four steps use both experts
    assert train_losses(tmp_path / "dp2") == pytest.approx(train_losses(tmp_path / "one"), rel=1e-5)
