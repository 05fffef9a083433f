"""``loong-embodied eval CKPT``: closed-loop rollouts of a trained policy in a gymnasium environment.

The policy (:func:`~loong.embodied.inference.load_policy`) acts through a :class:`PolicyActor`: each gymnasium
observation (LeRobot's gym layout, ``pixels`` / ``agent_pos``) becomes a robot observation with the env's
instruction (``task_description``, as LeRobot's environments name it), and the actions of each predicted chunk
are executed ``n_action_steps`` at a time. Episode ``i`` is reset with seed ``seed + i``, for the policy and for
the environment's random policy alike, so both face the same scenes; an episode succeeds when the env's last
``info["is_success"]`` says so, and its return is the sum of its rewards.

Written beside the checkpoint, in ``<run_dir>/eval/`` (or ``output``): ``step_N[_ema].json`` (the summary and
every episode), ``step_N[_ema].gif`` (the first few policy rollouts side by side, a green frame for a success,
red for a failure) and ``step_N[_ema].png`` (the same rollouts as a strip of frames, one row each).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from loong.core.errors import LoongError
from loong.embodied.inference import PolicyRunner, env_observation, load_policy, resolve_source

DEFAULT_ENV = "loong/Reach-v0"
#: frames of each episode in the PNG strip
STRIP_FRAMES = 8
SUCCESS_COLOUR, FAILURE_COLOUR = (40, 170, 60), (210, 40, 40)


class Actor(Protocol):
    """What :func:`rollout` drives (the reach task's ``ReachPolicy``): re-seeded per episode, then asked for one
    action per step."""

    def reset(self, seed: int | None) -> None: ...

    def __call__(self, observation: dict[str, Any], env: gym.Env) -> np.ndarray: ...


def task_of(env: gym.Env, info: Mapping[str, Any] | None = None) -> str | None:
    """The env's instruction: ``info["task"]`` or the env's ``task_description`` (LeRobot's name for it)."""
    if info is not None and isinstance(info.get("task"), str):
        return info["task"]
    task = getattr(env.unwrapped, "task_description", None)
    return task if isinstance(task, str) else None


class PolicyActor:
    """A :class:`PolicyRunner` as an :class:`Actor`: gymnasium observations in, one action per step out."""

    def __init__(self, runner: PolicyRunner) -> None:
        self.runner = runner

    def reset(self, seed: int | None) -> None:
        self.runner.reset(seed)

    def __call__(self, observation: dict[str, Any], env: gym.Env) -> np.ndarray:
        return self.runner.act(env_observation(observation, task_of(env)))


class ActionSpaceActor:
    """Uniform samples of the env's action space (the random baseline of an env that ships none)."""

    def __init__(self, space: gym.Space) -> None:
        self.space = space

    def reset(self, seed: int | None) -> None:
        self.space.seed(seed)

    def __call__(self, observation: dict[str, Any], env: gym.Env) -> np.ndarray:
        return np.asarray(self.space.sample())


def random_actor(env: gym.Env) -> Actor:
    """The env's own random policy (the reach task's :class:`RandomPolicy`), else uniform actions."""
    from loong.embodied.envs.reach import RandomPolicy, ReachEnv

    return RandomPolicy() if isinstance(env.unwrapped, ReachEnv) else ActionSpaceActor(env.action_space)


@dataclass
class EpisodeResult:
    """One rollout: its seed, whether it succeeded, the sum of its rewards, its steps, and (when recorded) the
    rendered frames, the first before any action."""

    seed: int
    success: bool
    ret: float
    length: int
    frames: list[np.ndarray] = field(default_factory=list, repr=False)


def rollout(env: gym.Env, actor: Actor, seed: int, *, record: bool = False,
            max_steps: int | None = None) -> EpisodeResult:
    """Reset ``env`` and ``actor`` with ``seed`` and run one episode to its end (or ``max_steps``)."""
    observation, info = env.reset(seed=seed)
    actor.reset(seed)
    frames = [env.render()] if record else []
    total, steps, done = 0.0, 0, False
    while not done:
        action = actor(observation, env)
        observation, reward, terminated, truncated, info = env.step(action)
        total += float(reward)
        steps += 1
        if record:
            frames.append(env.render())
        done = terminated or truncated or (max_steps is not None and steps >= max_steps)
    return EpisodeResult(seed, bool(info.get("is_success", False)), total, steps,
                         [f for f in frames if f is not None])


def summarise(results: Sequence[EpisodeResult]) -> dict[str, Any]:
    """Success rate, mean return and mean length of ``results``, and each episode's numbers."""
    n = len(results)
    return {
        "episodes": n,
        "successes": sum(r.success for r in results),
        "success_rate": sum(r.success for r in results) / n,
        "mean_return": sum(r.ret for r in results) / n,
        "mean_length": sum(r.length for r in results) / n,
        "per_episode": [{k: v for k, v in asdict(r).items() if k != "frames"} for r in results],
    }


def make_env(env_id: str, env_kwargs: Mapping[str, Any] | None = None) -> gym.Env:
    """``gym.make(env_id, **env_kwargs)`` with rendering on; ``loong/Reach-v0`` needs no import (it is
    registered here), another package's env id may be ``"module:Id"`` (gymnasium imports the module)."""
    from loong.embodied.envs import register_envs

    register_envs()
    kwargs = {"render_mode": "rgb_array", **(env_kwargs or {})}
    try:
        return gym.make(env_id, **kwargs)
    except gym.error.Error as exc:
        raise LoongError(f"--env {env_id}: {exc}") from None
    except TypeError as exc:
        raise LoongError(f"--env-kwarg: {env_id} does not take {dict(env_kwargs or {})} ({exc})") from None


def _progress(enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("success {task.fields[rate]}"), TimeElapsedColumn(),
                    console=Console(stderr=True), disable=not enabled, transient=False)


def run_episodes(env: gym.Env, actor: Actor, seeds: Sequence[int], *, record: int = 0, max_steps: int | None = None,
                 on_episode: Callable[[EpisodeResult], None] | None = None) -> list[EpisodeResult]:
    """One rollout per seed; the first ``record`` are rendered."""
    results = []
    for i, seed in enumerate(seeds):
        results.append(rollout(env, actor, seed, record=i < record, max_steps=max_steps))
        if on_episode is not None:
            on_episode(results[-1])
    return results


def _tile(frame: np.ndarray, colour: tuple[int, int, int], scale: int) -> np.ndarray:
    """A frame upscaled ``scale``x (nearest) inside a 2-pixel border of ``colour``."""
    big = np.repeat(np.repeat(np.asarray(frame, dtype=np.uint8)[..., :3], scale, 0), scale, 1)
    out = np.empty((big.shape[0] + 4, big.shape[1] + 4, 3), np.uint8)
    out[:] = colour
    out[2:-2, 2:-2] = big
    return out


def write_media(results: Sequence[EpisodeResult], gif: Path, png: Path, fps: float = 10.0) -> list[Path]:
    """The recorded rollouts of ``results`` as a GIF (side by side, shorter ones holding their last frame) and a
    PNG strip (one row each, :data:`STRIP_FRAMES` evenly spaced frames); returns what was written."""
    from PIL import Image

    recorded = [r for r in results if r.frames]
    if not recorded:
        return []
    scale = max(1, math.ceil(128 / max(r.frames[0].shape[0] for r in recorded)))

    def tile(r: EpisodeResult, t: int) -> np.ndarray:
        return _tile(r.frames[min(t, len(r.frames) - 1)], SUCCESS_COLOUR if r.success else FAILURE_COLOUR, scale)

    longest = max(len(r.frames) for r in recorded)
    frames = [Image.fromarray(np.concatenate([tile(r, t) for r in recorded], axis=1)) for t in range(longest)]
    gif.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)
    rows = [np.concatenate([tile(r, round(i * (len(r.frames) - 1) / (STRIP_FRAMES - 1)))
                            for i in range(STRIP_FRAMES)], axis=1) for r in recorded]
    Image.fromarray(np.concatenate(rows, axis=0)).save(png)
    return [gif, png]


def evaluate(ckpt: str | Path, *, env_id: str = DEFAULT_ENV, env_kwargs: Mapping[str, Any] | None = None,
             episodes: int = 20, seed: int = 0, ema: bool = False, device: str = "auto", dtype: str = "auto",
             n_action_steps: int | None = None, max_steps: int | None = None, random_baseline: bool = True,
             record: int = 4, output: str | Path | None = None, progress: bool = True,
             source: int | str | None = None) -> dict[str, Any]:
    """Roll the policy of ``ckpt`` out for ``episodes`` episodes (seeds ``seed ..``), and the env's random
    policy on the same seeds; write the summary JSON, GIF and PNG (see the module docstring) and return the
    summary (``summary["files"]``: what was written). ``source``: a mix-trained policy's dataset whose statistics
    and embodiment the env's observations and actions use (:func:`~loong.embodied.inference.resolve_source`)."""
    if not isinstance(episodes, int) or episodes < 1:
        raise LoongError(f"--episodes: must be an int >= 1, got {episodes!r}")
    if max_steps is not None and max_steps < 1:
        raise LoongError(f"--max-steps: must be >= 1, got {max_steps!r}")
    started = time.perf_counter()
    loaded = load_policy(ckpt, ema=ema, device=device, dtype=dtype)
    runner = PolicyRunner(loaded, seed=seed, n_action_steps=n_action_steps,
                          source=resolve_source(loaded.processor, source, "--source"))
    env = make_env(env_id, env_kwargs)
    seeds = [seed + i for i in range(episodes)]
    blocks: dict[str, list[EpisodeResult]] = {}
    try:
        with _progress(progress) as bar:
            for label, actor, rec in (("policy", PolicyActor(runner), record),
                                      *((("random", random_actor(env), 0),) if random_baseline else ())):
                done: list[EpisodeResult] = []
                task = bar.add_task(label, total=episodes, rate="-")

                def advance(result: EpisodeResult, task: Any = task, done: list[EpisodeResult] = done) -> None:
                    done.append(result)
                    bar.update(task, advance=1, rate=f"{sum(r.success for r in done) / len(done):.0%}")

                blocks[label] = run_episodes(env, actor, seeds, record=rec, max_steps=max_steps, on_episode=advance)
    finally:
        env.close()
    out_dir = Path(output) if output is not None else loaded.run_dir / "eval"
    stem = f"step_{loaded.step:08d}" + ("_ema" if ema else "")
    summary: dict[str, Any] = {
        "checkpoint": str(loaded.step_dir), "policy_name": loaded.name, "step": loaded.step, "ema": ema,
        "env": env_id, "env_kwargs": dict(env_kwargs or {}), "seeds": [seeds[0], seeds[-1]],
        "n_action_steps": runner.n_action_steps, "source": runner.source, "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        **{label: summarise(results) for label, results in blocks.items()},
    }
    if "random" in summary:
        summary["margin"] = summary["policy"]["success_rate"] - summary["random"]["success_rate"]
    files = write_media(blocks["policy"], out_dir / f"{stem}.gif", out_dir / f"{stem}.png")
    summary["seconds"] = round(time.perf_counter() - started, 2)
    summary_path = out_dir / f"{stem}.json"
    summary["files"] = [str(p) for p in (summary_path, *files)]
    out_dir.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


__all__ = ["DEFAULT_ENV", "ActionSpaceActor", "Actor", "EpisodeResult", "PolicyActor", "evaluate", "make_env",
           "random_actor", "rollout", "run_episodes", "summarise", "task_of", "write_media"]
