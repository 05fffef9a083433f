"""The training reader over a local LeRobotDataset v3 folder, through lerobot's own ``LeRobotDataset``.

Each sample is one frame with what a VLA policy trains on: every selected camera (float ``[c, h, w]`` in
``[0, 1]``), the state, the action chunk of the next ``chunk_size`` frames (``delta_timestamps``, so lerobot pads
past the episode's end by repeating its last action and says so in ``action_is_pad``), and the frame's task
string; ``n_obs_steps > 1`` adds an observation history (``[n_obs_steps, ...]`` plus ``<key>_is_pad``). Videos are
decoded by PyAV (its wheel bundles FFmpeg; torchcodec needs the system's FFmpeg libraries), in DataLoader
workers with :func:`make_dataloader`. The folder is checked before lerobot sees it, so that nothing is ever
fetched from the Hugging Face Hub and a broken folder fails with its path: a missing folder, ``meta/`` file,
episode data or video file, a key that is not a feature, a version other than v3, and (when a sample is read) a
video that cannot be decoded or a frame whose shape disagrees with ``meta/info.json``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from loong.core.errors import LoongError, did_you_mean

if TYPE_CHECKING:
    from lerobot.datasets.dataset_metadata import LeRobotDatasetMetadata
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

IMAGE_PREFIX = "observation.images."
#: the per-frame bookkeeping kept next to the features (lerobot's own column names)
INDEX_KEYS = ("episode_index", "frame_index", "index")


def read_info(root: Path) -> dict[str, Any]:
    """``meta/info.json`` of the LeRobotDataset folder ``root``, after checking the folder is one (v3)."""
    if not root.is_dir():
        raise LoongError(f"{root}: no such folder (a LeRobotDataset v3 folder, holding meta/info.json, is expected)")
    info_path = root / "meta" / "info.json"
    if not info_path.is_file():
        raise LoongError(f"{root}: not a LeRobotDataset folder (it has no meta/info.json)")
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoongError(f"{info_path}: cannot be read as JSON ({exc})") from exc
    version = str(info.get("codebase_version", "?"))
    if not version.startswith("v3."):
        raise LoongError(f"{info_path}: codebase_version {version}; Loong reads LeRobotDataset v3 (convert it with "
                         "`python -m lerobot.scripts.convert_dataset_v21_to_v30`)")
    for name in ("tasks.parquet", "episodes"):
        if not (root / "meta" / name).exists():
            raise LoongError(f"{root}: meta/{name} is missing (an incomplete LeRobotDataset folder)")
    return info


def _check_files(root: Path, meta: LeRobotDatasetMetadata, episodes: Sequence[int]) -> None:
    """Every episode's data file and video files exist (lerobot would otherwise go to the Hub for them)."""
    missing: dict[Path, list[int]] = {}
    for ep in episodes:
        paths = [meta.get_data_file_path(ep)] + [meta.get_video_file_path(ep, key) for key in meta.video_keys]
        for path in paths:
            if not (root / path).is_file():
                missing.setdefault(path, []).append(ep)
    if missing:
        shown = "; ".join(f"{path} (episodes {_ranges(eps)})" for path, eps in list(missing.items())[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise LoongError(f"{root}: missing episode files: {shown}{more}")


def _ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    out: list[str] = []
    for v in sorted(values):
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


class VLADataset(torch.utils.data.Dataset):
    """The frames of the LeRobotDataset v3 at ``root`` as training samples (see the module's docstring).

    ``cameras``: feature keys of the image/video features to read (default: all of them, in ``meta/info.json``
    order); ``state_key`` / ``action_key``: the state and action features; ``episodes``: a subset of episodes
    (default: all); ``video_backend``: ``"pyav"`` or ``"torchcodec"`` (needs the system's FFmpeg).
    """

    def __init__(self, root: str | Path, *, chunk_size: int, n_obs_steps: int = 1, cameras: Sequence[str] | None = None,
                 state_key: str = "observation.state", action_key: str = "action",
                 episodes: Sequence[int] | None = None, video_backend: str = "pyav", tolerance_s: float = 1e-4) -> None:
        from lerobot.datasets.dataset_metadata import LeRobotDatasetMetadata
        from lerobot.datasets.lerobot_dataset import LeRobotDataset

        for name, value in (("chunk_size", chunk_size), ("n_obs_steps", n_obs_steps)):
            if not isinstance(value, int) or value < 1:
                raise LoongError(f"{name}: must be an int >= 1, got {value!r}")
        if video_backend not in ("pyav", "torchcodec"):
            raise LoongError(f"video_backend: must be 'pyav' or 'torchcodec', got {video_backend!r}")
        self.root = Path(root).expanduser().resolve()
        info = read_info(self.root)
        features: dict[str, dict[str, Any]] = info.get("features", {})
        all_cameras = [k for k, ft in features.items() if ft.get("dtype") in ("image", "video")]
        self.camera_keys = list(all_cameras if cameras is None else cameras)
        for key in (*self.camera_keys, state_key, action_key):
            if key not in features:
                raise LoongError(f"{self.root}: no feature '{key}'{did_you_mean(key, features)}; its features: "
                                 f"{', '.join(features)}")
        for key in self.camera_keys:
            if key not in all_cameras:
                raise LoongError(f"{self.root}: feature '{key}' is a {features[key].get('dtype')}, not a camera; its "
                                 f"cameras: {', '.join(all_cameras) or 'none'}")
        self.state_key, self.action_key = state_key, action_key
        self.chunk_size, self.n_obs_steps = chunk_size, n_obs_steps
        self.repo_id = f"local/{self.root.name}"  # lerobot wants one; it only names the Hub repo, never used here
        self.meta: LeRobotDatasetMetadata = LeRobotDatasetMetadata(self.repo_id, root=self.root)
        total = self.meta.total_episodes
        if episodes is not None:
            bad = [ep for ep in episodes if not 0 <= ep < total]
            if bad or not episodes:
                raise LoongError(f"episodes: {list(episodes)!r} must be a non-empty list of episode indices "
                                 f"0..{total - 1} of {self.root}")
        self.episodes = None if episodes is None else sorted(set(episodes))
        _check_files(self.root, self.meta, self.episodes if self.episodes is not None else range(total))
        fps = self.meta.fps
        self.delta_timestamps: dict[str, list[float]] = {action_key: [t / fps for t in range(chunk_size)]}
        if n_obs_steps > 1:
            history = [(t - n_obs_steps + 1) / fps for t in range(n_obs_steps)]
            for key in (state_key, *self.camera_keys):
                self.delta_timestamps[key] = list(history)
        self.video_backend = video_backend
        self.lerobot: LeRobotDataset = LeRobotDataset(
            self.repo_id, root=self.root, episodes=self.episodes, delta_timestamps=self.delta_timestamps,
            tolerance_s=tolerance_s, video_backend=video_backend)
        self._tolerance_s = tolerance_s
        self._shapes = {key: self._expected_shape(key, features[key]) for key in (*self.camera_keys, state_key,
                                                                                  action_key)}

    def _expected_shape(self, key: str, feature: dict[str, Any]) -> tuple[int, ...]:
        """A sample's shape of ``key`` per ``meta/info.json`` (cameras channel-first, with history / chunk dims)."""
        shape = tuple(int(s) for s in feature.get("shape", ()))
        if key in self.camera_keys:
            names = feature.get("names") or ["height", "width", "channels"]
            if len(shape) != 3:
                raise LoongError(f"{self.root}/meta/info.json: camera '{key}' has shape {list(shape)}, not 3-D")
            shape = (shape[2], shape[0], shape[1]) if names[2] in ("channel", "channels") else shape
        lead = (self.chunk_size,) if key == self.action_key else (self.n_obs_steps,) if self.n_obs_steps > 1 else ()
        return lead + shape

    # what a policy is built from
    def sample_shape(self, key: str) -> tuple[int, ...]:
        """A sample's shape of the camera, state or action ``key`` (channel-first, with history / chunk dims)."""
        return self._shapes[key]

    @property
    def fps(self) -> int:
        """Frames per second of the dataset."""
        return int(self.meta.fps)

    @property
    def state_dim(self) -> int:
        """Size of the state vector."""
        return int(self._shapes[self.state_key][-1])

    @property
    def action_dim(self) -> int:
        """Size of the action vector."""
        return int(self._shapes[self.action_key][-1])

    @property
    def num_episodes(self) -> int:
        """Episodes read (all, or the selected ones)."""
        return int(self.lerobot.num_episodes)

    @property
    def tasks(self) -> list[str]:
        """The dataset's task strings, by task index."""
        return [] if self.meta.tasks is None else [str(t) for t in self.meta.tasks.index]

    @property
    def stats(self) -> dict[str, dict[str, Any]] | None:
        """``meta/stats.json`` as lerobot loads it (numpy arrays per statistic), or None when it is absent."""
        return self.meta.stats

    def __len__(self) -> int:
        return len(self.lerobot)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        try:
            item = self.lerobot[idx]
        except Exception as exc:
            broken = self._broken_videos(idx)
            if broken:
                raise LoongError("; ".join(broken)) from exc
            raise
        sample: dict[str, Any] = {}
        for key, shape in self._shapes.items():
            value = item[key]
            if tuple(value.shape) != shape:
                raise LoongError(f"{self.root}: '{key}' of episode {int(item['episode_index'])} frame "
                                 f"{int(item['frame_index'])} has shape {list(value.shape)}, but meta/info.json "
                                 f"declares one of {list(shape)}")
            sample[key] = value
        for key in item:
            if key.endswith("_is_pad"):
                sample[key] = item[key]
        for key in INDEX_KEYS:
            sample[key] = item[key]
        sample["task"] = item["task"]
        return sample

    def _broken_videos(self, idx: int) -> list[str]:
        """After a sample failed to load: its episode's videos that do not decode, one message each."""
        if not self.meta.video_keys or not -len(self) <= idx < len(self):
            return []
        ep = int(self.lerobot.hf_dataset[idx]["episode_index"])
        row = self.meta.episodes[ep]
        messages = []
        for key in self.meta.video_keys:
            path = self.root / self.meta.get_video_file_path(ep, key)
            start = float(row[f"videos/{key}/from_timestamp"])
            problem = probe_video(path, start, start + (int(row["length"]) - 1) / self.fps, self._tolerance_s)
            if problem is not None:
                messages.append(f"{path}: the video of '{key}' for episode {ep} cannot be decoded ({problem}); the "
                                "file is corrupt or truncated")
        return messages


def probe_video(path: Path, first: float, last: float, tolerance_s: float = 1e-4) -> str | None:
    """What stops ``path`` from decoding every frame from ``first`` to ``last`` seconds, or None when nothing does.

    PyAV directly and single-threaded: a multi-threaded dav1d (PyAV's default for AV1) that met corrupt data can
    deadlock when its context is freed, so the diagnosis adds no such context of its own."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.codec_context.thread_count = 1
            container.seek(max(0, round(first / stream.time_base) - 1), backward=True, any_frame=False, stream=stream)
            reached = None
            for frame in container.decode(stream):
                if frame.pts is not None:
                    reached = float(frame.pts * stream.time_base)
                    if reached >= last - tolerance_s:
                        return None
    except (av.error.FFmpegError, OSError, ValueError, IndexError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"no frame after {reached:.3f} s, but the episode lasts to {last:.3f} s" if reached is not None else \
        f"no frame from {first:.3f} s on"


def collate_vla(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack :class:`VLADataset` samples into a batch: tensors gain a leading batch dim (cameras
    ``[b, c, h, w]``, state ``[b, dim]``, ``action [b, chunk, dim]``, ``action_is_pad [b, chunk]``, and
    ``[b, n_obs_steps, ...]`` with history), ``task`` becomes a list of strings."""
    if not samples:
        raise ValueError("collate_vla: no samples")
    batch: dict[str, Any] = {}
    for key, first in samples[0].items():
        values = [s[key] for s in samples]
        if isinstance(first, torch.Tensor):
            batch[key] = torch.stack(values)
        elif isinstance(first, str):
            batch[key] = list(values)
        else:
            batch[key] = torch.as_tensor(values)
    return batch


def make_dataloader(dataset: VLADataset, *, batch_size: int, shuffle: bool = True, num_workers: int = 0,
                    seed: int = 0, drop_last: bool = False, pin_memory: bool = False,
                    sampler: torch.utils.data.Sampler | None = None, prefetch_factor: int | None = None,
                    timeout: float = 0.0) -> torch.utils.data.DataLoader:
    """A DataLoader over ``dataset`` with :func:`collate_vla`: ``num_workers`` processes decode videos (kept
    alive across epochs), the shuffle order is a function of ``seed``; ``timeout`` > 0 fails a batch that takes
    longer than that many seconds (0 waits forever)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise LoongError(f"batch_size: must be an int >= 1, got {batch_size!r}")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise LoongError(f"num_workers: must be an int >= 0, got {num_workers!r}")
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle if sampler is None else False, sampler=sampler,
        num_workers=num_workers, collate_fn=collate_vla, drop_last=drop_last, pin_memory=pin_memory,
        generator=generator, persistent_workers=num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None, timeout=timeout if num_workers > 0 else 0)


__all__ = ["VLADataset", "collate_vla", "make_dataloader", "probe_video", "read_info"]
