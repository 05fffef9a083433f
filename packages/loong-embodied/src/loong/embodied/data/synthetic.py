"""The synthetic task's dataset: expert episodes of the reach environment recorded into a LeRobotDataset v3.

Episode ``i`` of ``(num_episodes, seed)`` is the ``i``-th successful episode of the scripted expert over the
reset seeds :func:`episode_seed` ``(seed, 0), (seed, 1), ...`` (the expert fails almost never; a failure is skipped,
deterministically). Frames go through lerobot's own writer (``LeRobotDataset.create`` → ``add_frame`` →
``save_episode`` → ``finalize``), so the folder is exactly what ``lerobot-record`` would write:
``observation.images.top`` and ``observation.images.wrist`` (AV1 video through PyAV, whose wheel bundles FFmpeg
and SVT-AV1, or PNG images with ``use_videos=False``), ``observation.state`` (the agent's position, 2) and
``action`` (the velocity command, 2), at :data:`FPS` frames per second, with the instruction as the frame's task.
:func:`ensure_reach_dataset` writes it once per cache folder, atomically.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loong.core.errors import LoongError
from loong.embodied.envs.reach import CAMERAS, Episode, ExpertPolicy, ReachEnv, run_episode

VERSION = 1  # bump when the scene, the expert or the features change, so that cached copies are rebuilt
FPS = 10
REPO_ID = "loong/reach_synthetic"
ROBOT_TYPE = "point2d"
STATE_NAMES = ["x", "y"]
ACTION_NAMES = ["vx", "vy"]


def reach_features(image_size: int, use_videos: bool) -> dict[str, dict[str, Any]]:
    """The dataset's features in lerobot's ``features`` layout (images channel-last, as ``add_frame`` takes them)."""
    image = {"dtype": "video" if use_videos else "image", "shape": (image_size, image_size, 3),
             "names": ["height", "width", "channels"]}
    return {
        **{f"observation.images.{camera}": dict(image) for camera in CAMERAS},
        "observation.state": {"dtype": "float32", "shape": (2,), "names": list(STATE_NAMES)},
        "action": {"dtype": "float32", "shape": (2,), "names": list(ACTION_NAMES)},
    }


def episode_seed(seed: int, attempt: int) -> int:
    """The reset seed of the expert's ``attempt``-th episode for dataset seed ``seed`` (a stable mix, so that
    datasets of different seeds share no scene)."""
    return (seed * 1_000_003 + attempt) % (2**63 - 1)


def expert_episodes(num_episodes: int, *, seed: int = 0, image_size: int = 64, noise: float = 0.3,
                    max_steps: int = 50) -> Iterator[Episode]:
    """The ``num_episodes`` successful expert episodes of the dataset ``(num_episodes, seed)``, in order."""
    env = ReachEnv(image_size=image_size, max_steps=max_steps)
    policy = ExpertPolicy(noise=noise)
    found = attempt = 0
    try:
        while found < num_episodes:
            episode = run_episode(env, policy, episode_seed(seed, attempt))
            attempt += 1
            if episode.success:
                found += 1
                yield episode
            elif attempt >= 2 * num_episodes + 100:
                raise LoongError(f"the reach expert (noise={noise}, max_steps={max_steps}) solved only {found} of "
                                 f"{attempt} episodes; lower the noise or raise max_steps")
    finally:
        env.close()


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

    return Progress(
        TextColumn("[bold]reach dataset"), BarColumn(), MofNCompleteColumn(), TextColumn("episodes"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        console=Console(stderr=True), disable=not enabled, transient=False,
    )


def write_reach_dataset(root: str | Path, *, num_episodes: int, seed: int = 0, image_size: int = 64,
                        use_videos: bool = True, noise: float = 0.3, max_steps: int = 50,
                        progress: bool = True, action_scale: float = 1.0) -> Path:
    """Record ``num_episodes`` expert episodes into a new LeRobotDataset v3 at ``root`` (which must not exist).

    ``action_scale``: the recorded actions are the expert's times this (a dataset of other action statistics,
    e.g. the second source of a mix in the tests; the environment itself is unchanged)."""
    if not isinstance(num_episodes, int) or num_episodes < 1:
        raise LoongError(f"num_episodes: must be an int >= 1, got {num_episodes!r}")
    root = Path(root)
    if root.exists():
        raise LoongError(f"{root}: already exists; a LeRobotDataset is written into a new folder")
    with _quiet_writers():
        return _write(root, num_episodes=num_episodes, seed=seed, image_size=image_size,
                      use_videos=use_videos, noise=noise, max_steps=max_steps, progress=progress,
                      action_scale=action_scale)


@contextlib.contextmanager
def _quiet_writers() -> Iterator[None]:
    """Keep the progress bar readable while lerobot writes: SVT-AV1 prints its configuration for every video
    (``SVT_LOG=1`` keeps its errors; a value the user set wins), FFmpeg's muxer a line per file and ``datasets`` a
    bar per episode; the latter two are put back afterwards."""
    import av.logging
    import datasets

    os.environ.setdefault("SVT_LOG", "1")
    bars_were_on = not datasets.are_progress_bars_disabled()
    # FFmpeg's own threshold, not PyAV's Python-logging bridge: lerobot's encoder resets the bridge to FFmpeg's
    # default callback after each video, which prints whatever passes this threshold
    av.logging.set_libav_level(av.logging.WARNING)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        av.logging.set_libav_level(av.logging.INFO)  # FFmpeg's default (it has no getter to save the old one)
        if bars_were_on:
            datasets.enable_progress_bars()


@contextlib.contextmanager
def keep_scheduling() -> Iterator[None]:
    """Restore the calling thread's scheduling policy and priority on exit.

    Why: SVT-AV1 (lerobot's default video encoder, bundled in PyAV's wheels) moves the thread that runs it to
    ``SCHED_FIFO`` priority 99 when the process runs as root, and never back. Every thread and process started from
    it afterwards inherits real-time priority: on a machine with few cores, two busy-waiting processes (gloo ranks,
    DataLoader workers) then never yield and the rest starve (seen: a 4-rank CPU test that takes 105 s ran for
    over 30 min). Without ``os.sched_getscheduler`` (not Linux) it does nothing."""
    if not hasattr(os, "sched_getscheduler"):
        yield
        return
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority) != (policy, param.sched_priority):
            os.sched_setscheduler(0, policy, param)


def _write(root: Path, *, num_episodes: int, seed: int, image_size: int, use_videos: bool, noise: float,
           max_steps: int, progress: bool, action_scale: float = 1.0) -> Path:
    with keep_scheduling():
        return _write_episodes(root, num_episodes=num_episodes, seed=seed, image_size=image_size,
                               use_videos=use_videos, noise=noise, max_steps=max_steps, progress=progress,
                               action_scale=action_scale)


def _write_episodes(root: Path, *, num_episodes: int, seed: int, image_size: int, use_videos: bool, noise: float,
                    max_steps: int, progress: bool, action_scale: float) -> Path:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    dataset = LeRobotDataset.create(repo_id=REPO_ID, fps=FPS, features=reach_features(image_size, use_videos),
                                    root=root, robot_type=ROBOT_TYPE, use_videos=use_videos,
                                    video_backend="pyav")
    with _progress(progress) as bar:
        task = bar.add_task("reach", total=num_episodes)
        for episode in expert_episodes(num_episodes, seed=seed, image_size=image_size, noise=noise,
                                       max_steps=max_steps):
            for t in range(len(episode)):
                dataset.add_frame({
                    **{f"observation.images.{camera}": episode.images[camera][t] for camera in CAMERAS},
                    "observation.state": episode.states[t],
                    "action": (episode.actions[t] * action_scale).astype(episode.actions[t].dtype),
                    "task": episode.task,
                })
            # two 64² cameras encode faster in this process than in a pool of processes started per episode
            dataset.save_episode(parallel_encoding=False)
            bar.advance(task)
    dataset.finalize()
    return root


def reach_dataset_name(*, num_episodes: int, seed: int = 0, image_size: int = 64, use_videos: bool = True,
                       noise: float = 0.3, max_steps: int = 50) -> str:
    """The cache folder name of a reach dataset: every argument that changes its content is in it."""
    kind = "video" if use_videos else "image"
    return f"reach_v{VERSION}_n{num_episodes}_s{seed}_{image_size}px_{kind}_noise{noise:g}_max{max_steps}"


def ensure_reach_dataset(cache_dir: str | Path, *, num_episodes: int, seed: int = 0, image_size: int = 64,
                         use_videos: bool = True, noise: float = 0.3, max_steps: int = 50,
                         progress: bool = True) -> Path:
    """The reach dataset's folder under ``cache_dir``, written once: into a temporary folder beside it, then
    renamed into place, so that ranks writing it at the same time all end up reading one complete copy."""
    args = dict(num_episodes=num_episodes, seed=seed, image_size=image_size, use_videos=use_videos, noise=noise,
                max_steps=max_steps)
    target = Path(cache_dir) / reach_dataset_name(**args)
    if (target / "meta" / "info.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_reach_dataset(tmp / "dataset", progress=progress, **args)
        try:
            os.rename(tmp / "dataset", target)
        except OSError:  # another rank renamed its copy first
            if not (target / "meta" / "info.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


__all__ = [
    "FPS", "REPO_ID", "VERSION", "ensure_reach_dataset", "episode_seed", "expert_episodes", "reach_dataset_name",
    "reach_features", "write_reach_dataset",
]
