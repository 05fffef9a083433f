"""The synthetic task: "reach the <colour> target" in a 2-D scene seen through two rendered cameras.

A point agent moves in the square arena ``[-1, 1]²`` by velocity actions in ``[-1, 1]²`` (one step moves it at most
:data:`MAX_STEP` along each axis). The scene holds three or four discs of distinct colours; the instruction names
one of them, and the episode succeeds (and ends) when the agent's centre is within :data:`TARGET_RADIUS` of it.
Reaching a distractor does nothing, so the instruction has to be read: without it a policy can do no better than
guess the colour. The observation is lerobot's gym layout, ``{"pixels": {"top", "wrist"}, "agent_pos"}``: a top
camera over the whole arena and an egocentric "wrist" camera (the agent's neighbourhood, 2.2× zoomed, centred on
it), both ``uint8 [size, size, 3]``, and the agent's position as the state. Everything is a pure function of the
reset seed. A scripted :class:`ExpertPolicy` (privileged: it reads the target's position) and a
:class:`RandomPolicy` come with it; :func:`run_episode` records one episode of either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
from gymnasium import spaces

#: the id :mod:`loong.embodied.envs` registers (``gym.make("loong.embodied.envs:loong/Reach-v0")`` imports it)
ENV_ID = "loong/Reach-v0"
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
}
CAMERAS = ("top", "wrist")
ARENA = 1.0  # the agent lives in [-ARENA, ARENA]²
MAX_STEP = 0.1  # how far one step moves the agent along an axis for an action component of 1
TARGET_RADIUS = 0.1  # the drawn radius of a target and the success radius
AGENT_RADIUS = 0.07  # 2 px in a 64² top view, so the agent is visible there too
TOP_HALF_WIDTH = 1.1  # the top camera sees [-1.1, 1.1]²: the whole arena and a rim of its wall
WRIST_HALF_WIDTH = 0.5  # the wrist camera sees the agent ± 0.5
TARGET_BOX = 0.8  # target centres lie in [-0.8, 0.8]², so the whole disc is inside the arena
MIN_TARGET_GAP = 0.45  # between target centres: discs never touch, and the agent can tell which it is in
MIN_START_GAP = 0.5  # between the agent's start and every target, so no episode succeeds at once
BACKGROUND = (235, 235, 235)
WALL = (90, 90, 90)  # outside the arena
AGENT_COLOUR = (20, 20, 20)
DEFAULT_MAX_STEPS = 50


def instruction_for(colour: str) -> str:
    """The instruction (the LeRobotDataset task string) for target colour ``colour``."""
    return f"reach the {colour} target"


def _pixel_centres(size: int, half_width: float) -> tuple[np.ndarray, np.ndarray]:
    """World offsets ``(x [1, size], y [size, 1])`` of a ``size²`` camera's pixel centres (row 0 at the top)."""
    coords = -half_width + (np.arange(size, dtype=np.float64) + 0.5) * (2 * half_width / size)
    return coords[None, :], -coords[:, None]


class ReachEnv(gym.Env):
    """Reach the target whose colour the instruction (:attr:`task_description`) names.

    ``image_size``: the side of both cameras' square images; ``num_targets``: discs per scene (2–4), or None for
    three or four drawn per episode (the named one among two or three distractors); ``max_steps``: the episode cap
    (``truncated`` at that step unless it succeeded). ``info`` carries ``is_success``, ``distance`` (to the named
    target) and ``task`` (the instruction), as lerobot's environments do.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, image_size: int = 64, num_targets: int | None = None, max_steps: int = DEFAULT_MAX_STEPS,
                 render_mode: str | None = "rgb_array") -> None:
        if not isinstance(image_size, int) or image_size < 16:
            raise ValueError(f"image_size must be an int >= 16, got {image_size!r}")
        if num_targets is not None and not 2 <= num_targets <= len(COLOURS):
            raise ValueError(f"num_targets must be None or 2..{len(COLOURS)}, got {num_targets!r}")
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        self.image_size, self.num_targets, self.max_steps = image_size, num_targets, max_steps
        self.render_mode = render_mode
        image = spaces.Box(0, 255, (image_size, image_size, 3), np.uint8)
        self.observation_space = spaces.Dict({
            "pixels": spaces.Dict({camera: image for camera in CAMERAS}),
            "agent_pos": spaces.Box(-ARENA, ARENA, (2,), np.float32),
        })
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self._top_grid = _pixel_centres(image_size, TOP_HALF_WIDTH)
        self._wrist_grid = _pixel_centres(image_size, WRIST_HALF_WIDTH)
        self._colours: list[str] = []
        self._targets = np.zeros((0, 2))
        self._goal = 0
        self._agent = np.zeros(2)
        self._steps = 0

    # the scene, read by the expert policy, the recorder and tests
    @property
    def colours(self) -> list[str]:
        """The colours of the scene's targets, in the order of :attr:`target_positions`."""
        return list(self._colours)

    @property
    def target_positions(self) -> np.ndarray:
        """``[num_targets, 2]`` target centres."""
        return self._targets.copy()

    @property
    def target_colour(self) -> str:
        """The colour the instruction names."""
        return self._colours[self._goal]

    @property
    def target_position(self) -> np.ndarray:
        """The centre of the named target."""
        return self._targets[self._goal].copy()

    @property
    def agent_position(self) -> np.ndarray:
        """The agent's position (float64; the observation's ``agent_pos`` is this as float32)."""
        return self._agent.copy()

    @property
    def task_description(self) -> str:
        """The instruction, e.g. ``"reach the red target"`` (lerobot's environments name it so)."""
        return instruction_for(self.target_colour)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        """A new scene drawn from ``self.np_random`` (re-seeded when ``seed`` is given)."""
        super().reset(seed=seed)
        rng = self.np_random
        count = self.num_targets if self.num_targets is not None else int(rng.integers(3, 5))
        self._colours = [str(c) for c in rng.choice(sorted(COLOURS), size=count, replace=False)]
        targets: list[np.ndarray] = []
        while len(targets) < count:  # rejection sampling: at most 4 discs in a 1.6-wide box, so it ends fast
            candidate = rng.uniform(-TARGET_BOX, TARGET_BOX, 2)
            if all(np.linalg.norm(candidate - t) >= MIN_TARGET_GAP for t in targets):
                targets.append(candidate)
        self._targets = np.stack(targets)
        self._goal = int(rng.integers(count))
        while True:
            start = rng.uniform(-ARENA + AGENT_RADIUS, ARENA - AGENT_RADIUS, 2)
            if np.linalg.norm(self._targets - start, axis=1).min() >= MIN_START_GAP:
                break
        self._agent = start
        self._steps = 0
        return self._observation(), self._info(success=False)

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Move by ``MAX_STEP * clip(action, -1, 1)``, kept inside the arena; reward 1 and ``terminated`` on
        reaching the named target, ``truncated`` at ``max_steps``."""
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (2,) or not np.isfinite(a).all():
            raise ValueError(f"action must be 2 finite numbers, got {action!r}")
        self._agent = np.clip(self._agent + MAX_STEP * np.clip(a, -1.0, 1.0), -ARENA, ARENA)
        self._steps += 1
        success = bool(np.linalg.norm(self._agent - self._targets[self._goal]) <= TARGET_RADIUS)
        truncated = self._steps >= self.max_steps and not success
        return self._observation(), float(success), success, truncated, self._info(success)

    def render(self) -> np.ndarray | None:
        """The top camera's image (``render_mode="rgb_array"``), or None without a render mode."""
        return None if self.render_mode is None else self._draw(*self._top_grid)

    def _info(self, success: bool) -> dict[str, Any]:
        distance = float(np.linalg.norm(self._agent - self._targets[self._goal]))
        return {"is_success": success, "distance": distance, "task": self.task_description}

    def _observation(self) -> dict[str, Any]:
        wx, wy = self._wrist_grid
        return {
            "pixels": {"top": self._draw(*self._top_grid), "wrist": self._draw(wx + self._agent[0], wy + self._agent[1])},
            "agent_pos": self._agent.astype(np.float32),
        }

    def _draw(self, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
        """The scene at world points ``(xs [1, n], ys [n, 1])``: floor, wall, targets, then the agent on top."""
        image = np.empty((ys.shape[0], xs.shape[1], 3), np.uint8)
        image[:] = BACKGROUND
        image[(np.abs(xs) > ARENA) | (np.abs(ys) > ARENA)] = WALL
        for colour, (cx, cy) in zip(self._colours, self._targets, strict=True):
            image[(xs - cx) ** 2 + (ys - cy) ** 2 <= TARGET_RADIUS**2] = COLOURS[colour]
        image[(xs - self._agent[0]) ** 2 + (ys - self._agent[1]) ** 2 <= AGENT_RADIUS**2] = AGENT_COLOUR
        return image


class ReachPolicy(Protocol):
    """What :func:`run_episode` drives: re-seeded per episode, then asked for one action per step."""

    def reset(self, seed: int | None) -> None: ...

    def __call__(self, observation: dict[str, Any], env: gym.Env) -> np.ndarray: ...


class ExpertPolicy:
    """The scripted demonstrator: a proportional step towards the named target (capped at one full step, so it
    never overshoots), plus Gaussian noise of std ``noise`` per action component, clipped to ``[-1, 1]``. It reads
    the target from the environment (privileged), never from the pixels."""

    def __init__(self, noise: float = 0.3, seed: int | None = None) -> None:
        if not noise >= 0:
            raise ValueError(f"noise must be >= 0, got {noise!r}")
        self.noise = noise
        self._rng = np.random.default_rng(seed)

    def reset(self, seed: int | None) -> None:
        """Re-seed the noise."""
        self._rng = np.random.default_rng(seed)

    def __call__(self, observation: dict[str, Any], env: gym.Env) -> np.ndarray:
        scene: ReachEnv = env.unwrapped  # type: ignore[assignment]
        step = np.clip((scene.target_position - scene.agent_position) / MAX_STEP, -1.0, 1.0)
        return np.clip(step + self.noise * self._rng.standard_normal(2), -1.0, 1.0).astype(np.float32)


class RandomPolicy:
    """Uniform actions in ``[-1, 1]²``, ignoring everything: the baseline a learned policy must beat."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)

    def reset(self, seed: int | None) -> None:
        """Re-seed the actions."""
        self._rng = np.random.default_rng(seed)

    def __call__(self, observation: dict[str, Any], env: gym.Env) -> np.ndarray:
        return self._rng.uniform(-1.0, 1.0, 2).astype(np.float32)


@dataclass
class Episode:
    """One recorded episode: frame ``t`` is the observation at ``t`` and the action taken from it (lerobot's
    layout: the observation after the last action is not kept)."""

    task: str
    images: dict[str, list[np.ndarray]] = field(default_factory=lambda: {camera: [] for camera in CAMERAS})
    states: list[np.ndarray] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)
    success: bool = False

    def __len__(self) -> int:
        return len(self.actions)


def run_episode(env: gym.Env, policy: ReachPolicy, seed: int) -> Episode:
    """Reset ``env`` and ``policy`` with ``seed`` and run one episode to success or the cap."""
    observation, info = env.reset(seed=seed)
    policy.reset(seed)
    episode = Episode(task=info["task"])
    done = False
    while not done:
        action = np.asarray(policy(observation, env), dtype=np.float32)
        for camera in CAMERAS:
            episode.images[camera].append(observation["pixels"][camera])
        episode.states.append(observation["agent_pos"])
        episode.actions.append(action)
        observation, _, terminated, truncated, info = env.step(action)
        done = terminated or truncated
    episode.success = bool(info["is_success"])
    return episode


def success_rate(policy: ReachPolicy, episodes: int, seed: int = 0, **env_kwargs: Any) -> float:
    """The fraction of ``episodes`` episodes (seeds ``seed .. seed + episodes - 1``) that ``policy`` solves."""
    env = ReachEnv(**env_kwargs)
    try:
        return sum(run_episode(env, policy, seed + i).success for i in range(episodes)) / episodes
    finally:
        env.close()


__all__ = [
    "CAMERAS", "COLOURS", "ENV_ID", "Episode", "ExpertPolicy", "RandomPolicy", "ReachEnv", "ReachPolicy",
    "instruction_for", "run_episode", "success_rate",
]
