"""A mix of several LeRobotDataset v3 folders as one training source, each sample tagged with its embodiment.

API::

    mixture = build_mixture(["/data/aloha", "/data/so100"], [0.7, 0.3], chunk_size=50,
                            cameras=None, norm_map={"STATE": "QUANTILES", "ACTION": "QUANTILES"},
                            on_error="fail")           # -> VLAMixture
    sample, skipped = mixture.load(source, k)         # frame k of source's usable frames (sampler.EpisodeFrames)
    mixture[(source, k)], mixture[i]                  # the sample alone; i indexes all usable frames in order
    stream = mixture.stream(seed)                     # sampler.MixtureStream with the mixture's weights

A sample is what :class:`~loong.embodied.data.dataset.VLADataset` gives (cameras, ``observation.state``,
``action``, ``action_is_pad``, ``task``, ``episode_index`` / ``frame_index`` / ``index``), made uniform across
the sources so that :func:`~loong.embodied.data.dataset.collate_vla` stacks any mix of them:

- ``embodiment_id`` (int64 scalar): ``embodiment_ids[source]`` (default: the source's position in ``roots``; a
  mapping ``{root: id}`` or a list gives them explicitly, e.g. the ids of a pretrained GR00T's
  ``embodiment_id.json``); ``dataset_index`` (int64): the source's position in ``roots``.
- **Widths**: state and action are zero-padded on the last dim to the widest source (``mixture.state_dim`` /
  ``mixture.action_dim``, fixed for the mixture, so every batch has one static shape); ``mask.observation.state``
  ``[state_dim]`` and ``mask.action`` ``[action_dim]`` (bool) are True on a source's real dims. Policies pad
  further to their ``max_*_dim``. Padding follows normalisation, so padded dims are 0 in normalised units.
- **Cameras**: the union of the sources' cameras (or ``cameras``, each in at least one source). A source
  without a camera gives a zero image of the camera's shape and ``mask.<camera key>`` False (True where present),
  as lerobot's Pi0.5 and openpi treat a missing view; with ``n_obs_steps > 1`` its ``<camera>_is_pad`` is all
  True. One camera's image size must agree across sources unless ``image_size=(h, w)`` resizes all images
  (bilinear, antialiased).
- **Normalisation** (``norm_map`` given, a mode per feature type as :class:`~.normalize.Normalizer` takes): each
  source with its own ``meta/stats.json`` (``mixture.normalizers[source]``), in the DataLoader worker; the
  policy's processor must then not normalise again. ``norm_map=None`` leaves values raw.
- **Bad data** (``on_error``): ``"fail"`` raises :class:`LoongError` naming the dataset path, episode and key;
  ``"skip"`` replaces a sample that cannot be read by the next readable usable frame of the same source
  (``k + 1``, ``k + 2``, ... wrapping; deterministic) and returns what it skipped; at build time it leaves out
  episodes whose data or video files are missing (``mixture.build_skipped``). Configuration errors (a missing
  key, stats missing for a normalised key) always fail.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loong.core.errors import LoongError
from loong.embodied.data.dataset import INDEX_KEYS, VLADataset, read_info
from loong.embodied.data.normalize import Normalizer
from loong.embodied.data.sampler import EpisodeFrames, MixtureStream

logger = logging.getLogger("loong.embodied.data")

MASK_PREFIX = "mask."
ON_ERROR = ("fail", "skip")


def mask_key(key: str) -> str:
    """The batch key of ``key``'s presence mask (``mask.observation.images.top``, ``mask.action``)."""
    return MASK_PREFIX + key


@dataclass(frozen=True)
class SkippedSample:
    """A sample left out by ``on_error="skip"``: its dataset, episode, row (-1: a whole episode) and why."""

    root: str
    episode: int
    row: int
    message: str


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[-1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    if tuple(image.shape[-2:]) == size:
        return image
    flat = image.reshape(-1, *image.shape[-3:])
    out = torch.nn.functional.interpolate(flat.float(), size=size, mode="bilinear", align_corners=False,
                                          antialias=True)
    return out.reshape(*image.shape[:-2], *size).to(image.dtype)


class VLAMixture(torch.utils.data.Dataset):
    """Samples of several :class:`VLADataset` sources made uniform (see the module docstring); built by
    :func:`build_mixture`."""

    def __init__(self, sources: Sequence[VLADataset], frames: Sequence[EpisodeFrames], *,
                 weights: Sequence[float] | None = None, embodiment_ids: Sequence[int] | None = None,
                 cameras: Sequence[str] | None = None, norm_map: Mapping[Any, Any] | None = None,
                 image_size: tuple[int, int] | None = None, on_error: str = "fail",
                 max_consecutive_errors: int = 64, epoch_size: int | None = None,
                 build_skipped: Sequence[SkippedSample] = ()) -> None:
        if on_error not in ON_ERROR:
            raise LoongError(f"data.on_error: must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
        if not sources or len(sources) != len(frames):
            raise LoongError("a mixture needs at least one dataset and one frame list per dataset")
        self.sources, self.frames = list(sources), list(frames)
        self.roots = [str(ds.root) for ds in self.sources]
        self.on_error, self.max_consecutive_errors = on_error, max_consecutive_errors
        self.build_skipped = list(build_skipped)
        self.weights = None if weights is None else [float(w) for w in weights]
        self.epoch_size = epoch_size
        MixtureStream([len(f) for f in self.frames], self.weights, epoch_size=epoch_size)  # checks the weights
        ids = list(range(len(sources))) if embodiment_ids is None else [int(i) for i in embodiment_ids]
        if len(ids) != len(sources):
            raise LoongError(f"data.embodiment_ids: {len(ids)} ids for {len(sources)} datasets; give one each")
        self.embodiment_ids = ids
        keys = {(ds.state_key, ds.action_key, ds.n_obs_steps, ds.chunk_size) for ds in self.sources}
        if len(keys) > 1:
            raise LoongError(f"the mixed datasets disagree on (state key, action key, n_obs_steps, chunk_size): "
                             f"{sorted(keys)}")
        first = self.sources[0]
        self.state_key, self.action_key = first.state_key, first.action_key
        self.n_obs_steps, self.chunk_size = first.n_obs_steps, first.chunk_size
        self.state_dims = [ds.state_dim for ds in self.sources]
        self.action_dims = [ds.action_dim for ds in self.sources]
        self.state_dim, self.action_dim = max(self.state_dims), max(self.action_dims)
        union = list(dict.fromkeys(k for ds in self.sources for k in ds.camera_keys))
        self.camera_keys = union if cameras is None else list(cameras)
        self.image_size = None if image_size is None else (int(image_size[0]), int(image_size[1]))
        self.camera_shapes = {key: self._camera_shape(key) for key in self.camera_keys}
        self.normalizers = None if norm_map is None else [Normalizer.from_dataset(ds, norm_map)
                                                          for ds in self.sources]
        starts = [0]
        for f in self.frames:
            starts.append(starts[-1] + len(f))
        self._starts = starts

    def _camera_shape(self, key: str) -> tuple[int, ...]:
        shapes = {str(ds.root): ds.sample_shape(key) for ds in self.sources if key in ds.camera_keys}
        if not shapes:
            raise LoongError(f"camera '{key}': none of the mixed datasets has it ({', '.join(self.roots)})")
        if self.image_size is not None:
            return next(iter(shapes.values()))[:-2] + self.image_size
        if len(set(shapes.values())) > 1:
            shown = "; ".join(f"{root}: {list(shape)}" for root, shape in shapes.items())
            raise LoongError(f"camera '{key}' has different shapes in the mixed datasets ({shown}); give "
                             "data.image_size=[h, w] to resize them")
        return next(iter(shapes.values()))

    # ---- what a policy and the task are built from
    def stream(self, seed: int) -> MixtureStream:
        """The seeded sample stream over this mixture (its weights and epoch size)."""
        return MixtureStream([len(f) for f in self.frames], self.weights, seed=seed, epoch_size=self.epoch_size)

    @property
    def stats(self) -> list[dict[str, dict[str, Any]] | None]:
        """Each source's ``meta/stats.json`` (as lerobot loads it), by source."""
        return [ds.stats for ds in self.sources]

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        if isinstance(key, tuple):
            source, k = key
        else:
            if not 0 <= key < len(self):
                raise IndexError(f"sample {key} of a mixture of {len(self)}")
            source = max(i for i, s in enumerate(self._starts[:-1]) if s <= key)
            k = key - self._starts[source]
        return self.load(source, k)[0]

    # ---- reading
    def load(self, source: int, k: int) -> tuple[dict[str, Any], list[SkippedSample]]:
        """Usable frame ``k`` of ``source`` as a uniform sample, and the samples ``on_error="skip"`` passed over
        to find a readable one (empty when frame ``k`` itself was read)."""
        frames = self.frames[source]
        skipped: list[SkippedSample] = []
        for attempt in range(min(len(frames), self.max_consecutive_errors + 1)):
            kk = (k + attempt) % len(frames)
            row = frames.row(kk)
            try:
                return self._uniform(source, self.sources[source][row]), skipped
            except Exception as exc:  # any failure of one sample is this sample's: fail or skip it
                error = self._error(source, kk, exc)
                if self.on_error == "fail":
                    if error is exc:
                        raise
                    raise error from exc
                skipped.append(SkippedSample(self.roots[source], int(frames.episodes[kk]), row, str(error)))
        raise LoongError(f"{self.roots[source]}: {len(skipped)} consecutive samples could not be read (from "
                         f"episode {skipped[0].episode} row {skipped[0].row}); the last: {skipped[-1].message}")

    def _error(self, source: int, k: int, exc: Exception) -> Exception:
        if isinstance(exc, LoongError):  # the dataset's own errors name the path, episode and key
            return exc
        frames = self.frames[source]
        what = f"key {exc.args[0]!r}: " if isinstance(exc, KeyError) and exc.args else ""
        return LoongError(f"{self.roots[source]}: episode {int(frames.episodes[k])} (row {frames.row(k)}) cannot be "
                          f"read: {what}{type(exc).__name__}: {exc}")

    def _uniform(self, source: int, raw: dict[str, Any]) -> dict[str, Any]:
        ds = self.sources[source]
        if self.normalizers is not None:
            raw = self.normalizers[source].normalize(raw)
        sample: dict[str, Any] = {}
        masks: dict[str, torch.Tensor] = {}
        for key in self.camera_keys:
            present = key in ds.camera_keys
            if present:
                image = raw[key]
                sample[key] = _resize(image, self.image_size) if self.image_size is not None else image
            else:
                sample[key] = torch.zeros(self.camera_shapes[key], dtype=torch.float32)
            if self.n_obs_steps > 1:
                pad = f"{key}_is_pad"
                sample[pad] = raw[pad] if present else torch.ones(self.n_obs_steps, dtype=torch.bool)
            masks[mask_key(key)] = torch.tensor(present)
        sample[self.state_key] = _pad_last(raw[self.state_key], self.state_dim)
        sample[self.action_key] = _pad_last(raw[self.action_key], self.action_dim)
        for key, value in raw.items():
            if key.endswith("_is_pad") and key not in sample:
                sample[key] = value
        for key in INDEX_KEYS:
            sample[key] = raw[key]
        sample["task"] = raw["task"]
        masks[mask_key(self.state_key)] = torch.arange(self.state_dim) < self.state_dims[source]
        masks[mask_key(self.action_key)] = torch.arange(self.action_dim) < self.action_dims[source]
        sample.update(masks)
        sample["embodiment_id"] = torch.tensor(self.embodiment_ids[source], dtype=torch.int64)
        sample["dataset_index"] = torch.tensor(source, dtype=torch.int64)
        return sample


def _episodes_with_files(root: Path, episodes: Sequence[int] | None) -> tuple[list[int] | None, list[SkippedSample]]:
    """``episodes`` (None: all) less those whose data or video files are missing, and what was left out."""
    from lerobot.datasets.dataset_metadata import LeRobotDatasetMetadata

    meta = LeRobotDatasetMetadata(f"local/{root.name}", root=root)
    wanted = list(range(meta.total_episodes)) if episodes is None else list(episodes)
    keep, skipped = [], []
    for ep in wanted:
        if not 0 <= ep < meta.total_episodes:
            keep.append(ep)  # VLADataset names the bad index
            continue
        paths = [meta.get_data_file_path(ep)] + [meta.get_video_file_path(ep, key) for key in meta.video_keys]
        missing = [str(p) for p in paths if not (root / p).is_file()]
        if missing:
            skipped.append(SkippedSample(str(root), ep, -1, f"{root}: episode {ep}: missing {', '.join(missing)}"))
        else:
            keep.append(ep)
    if not keep:
        raise LoongError(f"{root}: every episode misses files (e.g. {skipped[0].message})")
    return (None if episodes is None and not skipped else keep), skipped


def build_mixture(roots: str | Path | Sequence[str | Path], weights: Sequence[float] | None = None, *,
                  chunk_size: int, cameras: Sequence[str] | None = None,
                  embodiment_ids: Sequence[int] | Mapping[str, int] | None = None,
                  norm_map: Mapping[Any, Any] | None = None, on_error: str = "fail", n_obs_steps: int = 1,
                  state_key: str = "observation.state", action_key: str = "action",
                  episodes: Sequence[Sequence[int] | None] | None = None, drop_first_frames: int = 0,
                  drop_last_frames: int = 0, image_size: Sequence[int] | None = None,
                  video_backend: str = "pyav", epoch_size: int | None = None,
                  max_consecutive_errors: int = 64) -> VLAMixture:
    """The :class:`VLAMixture` of the LeRobotDataset v3 folders ``roots`` (one path or several).

    ``weights``: sampling weight per dataset (normalised; default: proportional to each one's usable frames);
    ``cameras``: camera keys (default: the union of the datasets'); ``embodiment_ids``: a list (one per root) or
    a mapping ``{root: id}`` (roots compared resolved; every root needs an id); ``episodes``: per root, a list of
    episode indices or None (all); ``drop_first_frames`` / ``drop_last_frames``: frames left out at each
    episode's start / end; ``epoch_size``: samples per epoch of the stream (default: all usable frames).
    Other arguments as :class:`VLADataset` and the module docstring say.
    """
    if on_error not in ON_ERROR:
        raise LoongError(f"data.on_error: must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    paths = [Path(roots)] if isinstance(roots, (str, Path)) else [Path(r) for r in roots]
    if not paths:
        raise LoongError("data.repo_root: no dataset given")
    resolved = [p.expanduser().resolve() for p in paths]
    if len(set(resolved)) != len(resolved):
        raise LoongError(f"data.repo_root: a dataset is named twice ({', '.join(map(str, paths))})")
    if episodes is not None and len(episodes) != len(paths):
        raise LoongError(f"data.episodes: {len(episodes)} lists for {len(paths)} datasets; give one (or null) each")
    if isinstance(embodiment_ids, Mapping):
        by_root = {Path(k).expanduser().resolve(): int(v) for k, v in embodiment_ids.items()}
        missing = [str(p) for p in resolved if p not in by_root]
        if missing:
            raise LoongError(f"data.embodiment_ids: no id for {', '.join(missing)}")
        embodiment_ids = [by_root[p] for p in resolved]
    wanted_cameras = None if cameras is None else list(cameras)
    sources, frames, build_skipped = [], [], []
    for i, root in enumerate(resolved):
        features = read_info(root).get("features", {})
        own = None if wanted_cameras is None else [c for c in wanted_cameras if c in features]
        eps = None if episodes is None else episodes[i]
        if on_error == "skip":
            eps, skipped = _episodes_with_files(root, eps)
            for s in skipped:
                logger.warning("data.on_error=skip: leaving out %s", s.message)
            build_skipped += skipped
        ds = VLADataset(root, chunk_size=chunk_size, n_obs_steps=n_obs_steps, cameras=own, state_key=state_key,
                        action_key=action_key, episodes=eps, video_backend=video_backend)
        sources.append(ds)
        frames.append(EpisodeFrames.from_dataset(ds, drop_first=drop_first_frames, drop_last=drop_last_frames))
    size = None if image_size is None else (int(image_size[0]), int(image_size[1]))
    return VLAMixture(sources, frames, weights=weights, embodiment_ids=embodiment_ids, cameras=wanted_cameras,
                      norm_map=norm_map, image_size=size, on_error=on_error,
                      max_consecutive_errors=max_consecutive_errors, epoch_size=epoch_size,
                      build_skipped=build_skipped)


def check_mix(sources: Sequence[VLADataset]) -> None:
    """What a policy's processor needs of a mix: every dataset with the same cameras (the processors read a fixed
    camera list; give ``data.cameras`` to train on the ones they share) and the same fps (an action chunk then
    spans the same time in every dataset). Each disagreement names both datasets."""
    first = sources[0]
    for ds in sources[1:]:
        if sorted(ds.camera_keys) != sorted(first.camera_keys):
            shared = sorted(set(ds.camera_keys) & set(first.camera_keys))
            hint = (f"give data.cameras={shared} to train on the shared ones" if shared
                    else "they share no camera")
            raise LoongError(f"data.repo_root: the mixed datasets have different cameras: {first.root} has "
                             f"{', '.join(first.camera_keys)}; {ds.root} has {', '.join(ds.camera_keys)}; {hint}")
        if ds.fps != first.fps:
            raise LoongError(f"data.repo_root: the mixed datasets have different fps: {first.root} {first.fps}, "
                             f"{ds.root} {ds.fps} (an action chunk would span different times); resample one")


def check_embodiment_ids(ids: Sequence[int] | None, policy_config: Any) -> None:
    """``data.embodiment_ids`` against the policy: each below its ``num_embodiments`` (GR00T's per-embodiment
    rows); a policy without per-embodiment heads (Pi0.5) takes none."""
    if ids is None:
        return
    rows = getattr(policy_config, "num_embodiments", None)
    if rows is None:
        raise LoongError(f"data.embodiment_ids={list(ids)}: this policy has no per-embodiment heads (it has one "
                         "action space); leave data.embodiment_ids out")
    for i, value in enumerate(ids):
        if not 0 <= int(value) < rows:
            raise LoongError(f"data.embodiment_ids[{i}]={value}: must be below model.config.num_embodiments "
                             f"({rows})")


__all__ = ["MASK_PREFIX", "SkippedSample", "VLAMixture", "build_mixture", "check_embodiment_ids", "check_mix",
           "mask_key"]
