"""The synthetic reach task: determinism from the seed, the rendered scene, the dynamics, the expert's and the
random policy's success rates, bad arguments, and that importing loong.embodied stays cheap."""

from __future__ import annotations

import subprocess
import sys
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from loong.embodied.envs import (
    CAMERAS,
    COLOURS,
    ENV_ID,
    ExpertPolicy,
    RandomPolicy,
    ReachEnv,
    run_episode,
    success_rate,
)
from loong.embodied.envs import reach as R


def _world_to_top_pixel(env: ReachEnv, point: np.ndarray) -> tuple[int, int]:
    """(row, col) of the top camera's pixel whose centre is nearest to the world point."""
    scale = env.image_size / (2 * R.TOP_HALF_WIDTH)
    col = int(np.floor((point[0] + R.TOP_HALF_WIDTH) * scale))
    row = int(np.floor((R.TOP_HALF_WIDTH - point[1]) * scale))
    return row, col


def _equal_observations(a: dict, b: dict) -> bool:
    return all(np.array_equal(a["pixels"][c], b["pixels"][c]) for c in CAMERAS) and np.array_equal(
        a["agent_pos"], b["agent_pos"])


def test_same_seed_same_episode_and_gym_make() -> None:
    env_a, env_b = ReachEnv(), gym.make(f"loong.embodied.envs:{ENV_ID}")
    obs_a, info_a = env_a.reset(seed=7)
    obs_b, info_b = env_b.reset(seed=7)
    assert _equal_observations(obs_a, obs_b) and info_a == info_b
    rng = np.random.default_rng(0)
    for _ in range(10):
        action = rng.uniform(-1, 1, 2)
        step_a, step_b = env_a.step(action), env_b.step(action)
        assert _equal_observations(step_a[0], step_b[0]) and step_a[1:] == step_b[1:]
    # a recorded episode is a function of its seed; another seed gives another scene
    first, again = run_episode(env_a, ExpertPolicy(), 3), run_episode(ReachEnv(), ExpertPolicy(), 3)
    assert first.task == again.task and len(first) == len(again)
    assert all(np.array_equal(x, y) for x, y in zip(first.actions, again.actions, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(first.images["wrist"], again.images["wrist"], strict=True))
    scenes = set()
    for seed in range(20):
        env_a.reset(seed=seed)
        scenes.add((tuple(env_a.colours), env_a.target_colour, env_a.target_positions.round(6).tobytes()))
    assert len(scenes) == 20


def test_gymnasium_api_and_scene_layout_and_rendering() -> None:
    with warnings.catch_warnings():  # gymnasium's own checker of the Env API: any warning is a failure
        warnings.simplefilter("error")
        check_env(gym.make(ENV_ID).unwrapped)
    env = ReachEnv(image_size=64)
    seen_counts, seen_goals = set(), set()
    for seed in range(40):
        obs, info = env.reset(seed=seed)
        assert env.observation_space.contains(obs)
        colours, targets = env.colours, env.target_positions
        seen_counts.add(len(colours))
        seen_goals.add(env.target_colour)
        assert len(set(colours)) == len(colours) and set(colours) <= set(COLOURS)
        assert info["task"] == env.task_description == f"reach the {env.target_colour} target"
        gaps = [np.linalg.norm(p - q) for i, p in enumerate(targets) for q in targets[i + 1:]]
        assert min(gaps) >= R.MIN_TARGET_GAP and np.abs(targets).max() <= R.TARGET_BOX
        assert np.linalg.norm(targets - env.agent_position, axis=1).min() >= R.MIN_START_GAP
        top, wrist = obs["pixels"]["top"], obs["pixels"]["wrist"]
        for colour, centre in zip(colours, targets, strict=True):  # every disc is drawn where it is, in its colour
            assert tuple(top[_world_to_top_pixel(env, centre)]) == COLOURS[colour]
            assert (top == COLOURS[colour]).all(-1).sum() > 10
        assert tuple(top[_world_to_top_pixel(env, env.agent_position)]) == R.AGENT_COLOUR
        assert tuple(wrist[32, 32]) == R.AGENT_COLOUR  # the egocentric camera is centred on the agent
        assert tuple(top[0, 0]) == R.WALL  # the rim outside the arena
    assert seen_counts == {3, 4} and seen_goals == set(COLOURS)
    env2 = ReachEnv(num_targets=2)
    env2.reset(seed=1)
    assert len(env2.colours) == 2
    np.testing.assert_array_equal(env.render(), env._observation()["pixels"]["top"])


def test_dynamics_success_and_cap() -> None:
    env = ReachEnv(max_steps=5)
    env.reset(seed=0)
    start = env.agent_position
    obs, reward, terminated, truncated, info = env.step([2.0, -0.5])  # clipped to [1, -0.5]
    np.testing.assert_allclose(env.agent_position, np.clip(start + R.MAX_STEP * np.array([1.0, -0.5]), -1, 1))
    np.testing.assert_array_equal(obs["agent_pos"], env.agent_position.astype(np.float32))
    assert (reward, terminated, truncated, info["is_success"]) == (0.0, False, False, False)
    for _ in range(3):
        assert env.step([0.0, 0.0])[3] is False
    assert env.step([0.0, 0.0])[3] is True  # the 5th step hits the cap
    # walking straight at the target succeeds, with reward 1, and ends the episode
    env = ReachEnv()
    env.reset(seed=4)
    policy = ExpertPolicy(noise=0.0)
    for _ in range(40):
        _, reward, terminated, truncated, info = env.step(policy({}, env))
        if terminated or truncated:
            break
    assert terminated and not truncated and reward == 1.0 and info["is_success"]
    assert info["distance"] <= R.TARGET_RADIUS
    # the arena's wall holds
    env.reset(seed=0)
    for _ in range(30):
        env.step([-1.0, -1.0])
    np.testing.assert_array_equal(env.agent_position, [-1.0, -1.0])


def test_success_rates_expert_and_random() -> None:
    """Measured over 1000 episodes each (seeds 0-999): expert (noise 0.3) 100 %, random 2.5 %."""
    expert = success_rate(ExpertPolicy(noise=0.3), episodes=100, seed=1000)
    random = success_rate(RandomPolicy(), episodes=200, seed=1000)
    assert expert >= 0.9, expert
    assert random <= 0.1, random
    # the noise is real: the expert's actions are not a deterministic function of the scene
    env = ReachEnv()
    noisy, clean = run_episode(env, ExpertPolicy(noise=0.3), 5), run_episode(env, ExpertPolicy(noise=0.0), 5)
    assert not np.array_equal(noisy.actions[0], clean.actions[0])


def test_bad_arguments() -> None:
    for kwargs in ({"image_size": 8}, {"num_targets": 1}, {"num_targets": 5}, {"max_steps": 0},
                   {"render_mode": "human"}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            ReachEnv(**kwargs)
    env = ReachEnv()
    env.reset(seed=0)
    for action in ([1.0], [np.nan, 0.0], [[0.0, 0.0]]):
        with pytest.raises(ValueError, match="action must be 2 finite numbers"):
            env.step(action)
    with pytest.raises(ValueError, match="noise"):
        ExpertPolicy(noise=-1)


def test_importing_loong_embodied_is_cheap() -> None:
    """The package and its data modules import neither lerobot nor (for the package and envs) torch."""
    code = ("import sys, loong.embodied, loong.embodied.envs; assert 'torch' not in sys.modules; "
            "import loong.embodied.data.dataset, loong.embodied.data.synthetic, loong.embodied.data.normalize; "
            "assert not [m for m in sys.modules if m.startswith('lerobot')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
