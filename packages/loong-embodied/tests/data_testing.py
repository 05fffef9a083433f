"""Tiny LeRobotDatasets for the mixture and loader tests, written through lerobot's own writer.

:func:`write_tiny_dataset` makes a dataset of any state/action width and camera set (PNG images, so no video
encoding), whose values name the frame: ``state[0] = tag + 100 · episode + frame`` and ``action[i] = state[0] +
i / 10``, so a test can tell which source, episode and frame a sample is from its values alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

FPS = 10


def frame_code(tag: int, episode: int, frame: int) -> float:
    """``state[0]`` of ``frame`` of ``episode`` in the dataset written with ``tag``."""
    return float(tag + 100 * episode + frame)


def write_tiny_dataset(root: Path, *, state_dim: int, action_dim: int, cameras: Sequence[str],
                       lengths: Sequence[int], tag: int, image_size: int = 16, task: str = "tiny task",
                       file_per_episode: bool = False) -> Path:
    """A LeRobotDataset v3 at ``root`` with episodes of ``lengths`` frames (see the module docstring);
    ``file_per_episode``: each episode's frames in a data file of their own (a tiny file size limit)."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    features = {
        **{f"observation.images.{c}": {"dtype": "image", "shape": (image_size, image_size, 3),
                                       "names": ["height", "width", "channels"]} for c in cameras},
        "observation.state": {"dtype": "float32", "shape": (state_dim,), "names": [f"s{i}" for i in range(state_dim)]},
        "action": {"dtype": "float32", "shape": (action_dim,), "names": [f"a{i}" for i in range(action_dim)]},
    }
    ds = LeRobotDataset.create(repo_id="loong/tiny", fps=FPS, features=features, root=root, use_videos=False,
                               data_files_size_in_mb=1e-6 if file_per_episode else None)
    rng = np.random.default_rng(tag)
    for ep, length in enumerate(lengths):
        for t in range(length):
            code = frame_code(tag, ep, t)
            state = np.full(state_dim, code, dtype=np.float32)
            state[1:] = rng.normal(size=state_dim - 1)
            action = (code + np.arange(action_dim) / 10).astype(np.float32)
            ds.add_frame({
                **{f"observation.images.{c}": rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)
                   for c in cameras},
                "observation.state": state, "action": action, "task": f"{task} {ep}",
            })
        ds.save_episode(parallel_encoding=False)
    ds.finalize()
    return root
