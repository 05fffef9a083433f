"""The policy config group: each option sets the policy and preset; the published options also carry the published
training schedule (lerobot 0.6.1's PI05Config / GrootConfig defaults), and the command line still overrides it."""

from __future__ import annotations

import pytest

from loong.core.config import compose_config
from loong.embodied.cli import CONFIG_MODULE
from loong.embodied.schema import EmbodiedRunConfig, hydra_overrides

CONFIG_NAME = "train"


def compose(*overrides: str) -> EmbodiedRunConfig:
    cfg, _ = compose_config(CONFIG_MODULE, CONFIG_NAME, hydra_overrides(list(overrides)), EmbodiedRunConfig)
    return cfg


def lerobot_schedule(policy: str) -> dict:
    """The optimiser and scheduler defaults of lerobot's config class for ``policy`` (the oracle)."""
    if policy == "pi05":
        from lerobot.policies.pi05.configuration_pi05 import PI05Config

        c = PI05Config()
        return {"lr": c.optimizer_lr, "min_lr": c.scheduler_decay_lr, "warmup_steps": c.scheduler_warmup_steps,
                "steps": c.scheduler_decay_steps, "weight_decay": c.optimizer_weight_decay,
                "adam_beta1": c.optimizer_betas[0], "adam_beta2": c.optimizer_betas[1],
                "clip_grad": c.optimizer_grad_clip_norm}
    from lerobot.policies.groot.configuration_groot import GrootConfig

    c = GrootConfig()
    return {"lr": c.optimizer_lr, "min_lr": 0.0, "warmup_steps": round(c.max_steps * c.warmup_ratio),
            "steps": c.max_steps, "weight_decay": c.optimizer_weight_decay, "adam_beta1": c.optimizer_betas[0],
            "adam_beta2": c.optimizer_betas[1], "clip_grad": c.get_optimizer_preset().grad_clip_norm,
            "global_batch_size": c.batch_size}


@pytest.mark.parametrize("option,lerobot_policy", [("pi05", "pi05"), ("groot_n1_7", "groot"), ("groot_n1_6", "groot")])
def test_published_options_carry_the_published_schedule(option: str, lerobot_policy: str) -> None:
    cfg = compose(f"policy={option}")
    assert (cfg.model.policy, cfg.model.preset) == (option, option)
    expected = lerobot_schedule(lerobot_policy)
    got = {key: getattr(cfg.train, key) for key in expected}
    assert got == pytest.approx(expected), f"policy={option}: {got} != lerobot's {expected}"
    assert cfg.train.precision == "bf16" and cfg.train.lr_decay_style == "cosine"


def test_the_command_line_overrides_a_policy_schedule() -> None:
    cfg = compose("policy=pi05", "train.lr=1e-4", "train.steps=500")
    assert (cfg.train.lr, cfg.train.steps, cfg.train.min_lr) == (1e-4, 500, 2.5e-6)


@pytest.mark.parametrize("option", ["pi05_tiny", "groot_n1_7_tiny", "groot_n1_6_tiny"])
def test_tiny_options_keep_the_default_runs_schedule(option: str) -> None:
    default = compose()
    cfg = compose(f"policy={option}")
    assert cfg.model.preset == "tiny" or cfg.model.preset.endswith("tiny")
    assert cfg.train == default.train, f"policy={option} changed the default run's train keys"
