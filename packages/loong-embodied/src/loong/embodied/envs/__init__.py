"""Gymnasium environments of loong-embodied: the synthetic reach task (:mod:`.reach`), registered as
``loong/Reach-v0`` when this module is imported (``gym.make("loong.embodied.envs:loong/Reach-v0")`` does that)."""

from __future__ import annotations

import gymnasium as gym

from .reach import (
    CAMERAS,
    COLOURS,
    ENV_ID,
    Episode,
    ExpertPolicy,
    RandomPolicy,
    ReachEnv,
    ReachPolicy,
    instruction_for,
    run_episode,
    success_rate,
)


def register_envs() -> None:
    """Register :data:`ENV_ID` with gymnasium (once; gymnasium keeps its registry per process)."""
    if ENV_ID not in gym.registry:
        gym.register(id=ENV_ID, entry_point="loong.embodied.envs.reach:ReachEnv")


register_envs()

__all__ = [
    "CAMERAS", "COLOURS", "ENV_ID", "Episode", "ExpertPolicy", "RandomPolicy", "ReachEnv", "ReachPolicy",
    "instruction_for", "register_envs", "run_episode", "success_rate",
]
