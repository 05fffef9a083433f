"""Normalisation from a LeRobotDataset's ``meta/stats.json``, by lerobot's own processor steps.

A policy names a mode per feature type, as lerobot's policy configs do (``normalization_mapping``): Pi0.5 uses
``{"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}``, ACT and Diffusion ``MEAN_STD`` /
``MIN_MAX``. The arithmetic is lerobot's ``NormalizerProcessorStep`` / ``UnnormalizerProcessorStep`` (so a policy
exported to lerobot normalises exactly as it trained here): ``MEAN_STD`` is ``(x - mean) / (std + eps)``,
``MIN_MAX`` maps ``[min, max]`` to ``[-1, 1]``, ``QUANTILES`` maps ``[q01, q99]`` and ``QUANTILE10`` ``[q10, q90]``
to ``[-1, 1]``. What this adds is the checks lerobot leaves out: it silently skips a key whose statistics are
missing; here that is an error naming the stats file, the key and the statistics the mode needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from loong.core.errors import LoongError

if TYPE_CHECKING:
    from loong.embodied.data.dataset import VLADataset

#: the statistics each mode reads (lerobot's NormalizationMode values)
NEEDED_STATS: dict[str, tuple[str, ...]] = {
    "IDENTITY": (),
    "MEAN_STD": ("mean", "std"),
    "MIN_MAX": ("min", "max"),
    "QUANTILES": ("q01", "q99"),
    "QUANTILE10": ("q10", "q90"),
}
FEATURE_TYPES = ("VISUAL", "STATE", "ACTION", "ENV")


def _mode_name(value: Any) -> str:
    return str(getattr(value, "value", value)).upper()


class Normalizer:
    """(Un)normalises the observation and action keys of a batch with the statistics ``stats``.

    ``features``: lerobot's dataset features (``meta/info.json``'s ``features``) of the keys to normalise;
    ``norm_map``: a mode per feature type (strings or lerobot's enums; a type left out is ``IDENTITY``);
    ``source``: what the statistics came from, for error messages.
    """

    def __init__(self, stats: Mapping[str, Mapping[str, Any]] | None, features: Mapping[str, Mapping[str, Any]],
                 norm_map: Mapping[Any, Any], *, source: str = "stats", eps: float = 1e-8) -> None:
        from lerobot.configs import FeatureType, NormalizationMode
        from lerobot.processor import NormalizerProcessorStep, UnnormalizerProcessorStep
        from lerobot.utils.feature_utils import dataset_to_policy_features

        modes: dict[str, str] = {}
        for kind, mode in norm_map.items():
            kind_name, mode_name = _mode_name(kind), _mode_name(mode)
            if kind_name not in FEATURE_TYPES:
                raise LoongError(f"norm_map: unknown feature type {kind_name!r}; known: {', '.join(FEATURE_TYPES)}")
            if mode_name not in NEEDED_STATS:
                raise LoongError(f"norm_map.{kind_name}: unknown mode {mode_name!r}; known: {', '.join(NEEDED_STATS)}")
            modes[kind_name] = mode_name
        self.policy_features = dataset_to_policy_features(dict(features))
        self.modes = {key: modes.get(ft.type.value, "IDENTITY") for key, ft in self.policy_features.items()}
        for key, mode in self.modes.items():
            needed = NEEDED_STATS[mode]
            if not needed:
                continue
            if stats is None:
                raise LoongError(f"{source}: missing; '{key}' is normalised by {mode}, which needs {', '.join(needed)}")
            have = stats.get(key)
            if have is None:
                raise LoongError(f"{source}: no statistics for '{key}', which is normalised by {mode} (needs "
                                 f"{', '.join(needed)}); it has statistics for: {', '.join(stats) or 'nothing'}")
            missing = [name for name in needed if name not in have]
            if missing:
                raise LoongError(f"{source}: '{key}' has no {', '.join(missing)} (needed by {mode}); it has: "
                                 f"{', '.join(have)}")
        used = {key for key, mode in self.modes.items() if mode != "IDENTITY"}
        self.stats = {key: dict(stats[key]) for key in used} if stats is not None else {}
        self.action_key = next((k for k, ft in self.policy_features.items() if ft.type.value == "ACTION"), None)
        enum_map = {FeatureType(kind): NormalizationMode(mode) for kind, mode in modes.items()}
        self._normalize = NormalizerProcessorStep(features=self.policy_features, norm_map=enum_map,
                                                  stats=self.stats, eps=eps)
        self._unnormalize = UnnormalizerProcessorStep(features=self.policy_features, norm_map=enum_map,
                                                      stats=self.stats, eps=eps)

    @classmethod
    def from_dataset(cls, dataset: VLADataset, norm_map: Mapping[Any, Any], eps: float = 1e-8) -> Normalizer:
        """The normaliser of ``dataset``'s cameras, state and action with its ``meta/stats.json``."""
        keys = (*dataset.camera_keys, dataset.state_key, dataset.action_key)
        features = {key: dataset.meta.features[key] for key in keys}
        return cls(dataset.stats, features, norm_map, source=str(Path(dataset.root) / "meta" / "stats.json"), eps=eps)

    def _apply(self, step: Any, batch: Mapping[str, Any]) -> dict[str, Any]:
        from lerobot.processor import TransitionKey, create_transition

        observation = {k: v for k, v in batch.items() if k in self.policy_features and k != self.action_key}
        action = batch.get(self.action_key) if self.action_key is not None else None
        out = step(create_transition(observation=observation or None, action=action))
        result = dict(batch)
        result.update(out[TransitionKey.OBSERVATION] or {})
        if action is not None:
            result[self.action_key] = out[TransitionKey.ACTION]
        return result

    def normalize(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``batch`` with its feature keys normalised (other keys as they are)."""
        return self._apply(self._normalize, batch)

    def unnormalize(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`normalize`."""
        return self._apply(self._unnormalize, batch)

    def unnormalize_action(self, action: torch.Tensor) -> torch.Tensor:
        """A policy's normalised action (``[..., action_dim]``) in the dataset's units."""
        if self.action_key is None:
            raise LoongError("unnormalize_action: this normaliser has no action feature")
        return self.unnormalize({self.action_key: action})[self.action_key]


#: the batch key of each sample's source dataset (its position in ``data.repo_root``; set by the mixture)
SOURCE_KEY = "dataset_index"
#: the saved processor's record of a mix's sources (absent for one dataset)
SOURCES_FILE = "sources.json"


def source_index(batch: Mapping[str, Any], b: int, num_sources: int, who: str) -> torch.Tensor:
    """``[b]`` int64: each sample's source (``batch["dataset_index"]``; absent: all source 0). A processor built
    for ``num_sources`` sources refuses an index outside ``0..num_sources - 1``."""
    value = batch.get(SOURCE_KEY)
    if value is None:
        return torch.zeros(b, dtype=torch.long)
    index = torch.as_tensor(value).long().reshape(-1)
    if index.numel() == 1 and b > 1:
        index = index.expand(b)
    if index.numel() != b:
        raise LoongError(f"{who}: '{SOURCE_KEY}' has {index.numel()} entries for a batch of {b}")
    bad = index[(index < 0) | (index >= num_sources)]
    if bad.numel():
        raise LoongError(f"{who}: '{SOURCE_KEY}' {int(bad[0])} is not one of the processor's {num_sources} "
                         "source dataset(s)")
    return index


def normalize_by_source(normalizers: list[Normalizer], batch: Mapping[str, torch.Tensor],
                        index: torch.Tensor) -> dict[str, torch.Tensor]:
    """``batch`` (tensors with the batch first) with row ``i`` normalised by ``normalizers[index[i]]``."""
    if len(normalizers) == 1:
        return normalizers[0].normalize(batch)
    out = {key: value.clone() for key, value in batch.items()}
    for source in index.unique().tolist():
        rows = index == source
        normed = normalizers[source].normalize({key: value[rows] for key, value in batch.items()})
        for key in batch:
            out[key][rows] = normed[key].to(out[key].dtype)
    return out


def min_max_stats(stats: Mapping[str, Mapping[str, Any]] | None, keys: Sequence[str], source: str,
                  dims: Sequence[int]) -> dict[str, dict[str, torch.Tensor]]:
    """``{key: {"min", "max"}}`` flat fp32 tensors of ``keys`` from ``stats``, each of ``dims`` entries."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, dim in zip(keys, dims, strict=True):
        have = stats.get(key) if stats is not None else None
        if have is None or "min" not in have or "max" not in have:
            raise LoongError(f"{source}: '{key}' needs min and max statistics (GR00T min-max normalisation); "
                             f"it has: {', '.join(have or []) or 'nothing'}")
        out[key] = {n: torch.as_tensor(have[n], dtype=torch.float32).flatten() for n in ("min", "max")}
        if out[key]["min"].numel() != dim:
            raise LoongError(f"{source}: '{key}' has {out[key]['min'].numel()} dims; the first dataset's has {dim}")
    return out


def check_same_dims(datasets: Sequence[VLADataset], policy: str) -> None:
    """A mix whose datasets disagree on state or action dims stops naming both (one processor width)."""
    first = datasets[0]
    for ds in datasets[1:]:
        if (ds.state_dim, ds.action_dim) != (first.state_dim, first.action_dim):
            raise LoongError(f"data.repo_root: {policy} mixes datasets of one state/action width; {first.root} has "
                             f"state {first.state_dim} / action {first.action_dim} dims, {ds.root} has state "
                             f"{ds.state_dim} / action {ds.action_dim}")


def write_sources(directory: Path, sources: list[dict[str, Any]]) -> None:
    """``sources.json``: a mix's sources in order (``root``, ``name``, ``embodiment_id``)."""
    import json

    (Path(directory) / SOURCES_FILE).write_text(json.dumps({"sources": sources}, indent=2), encoding="utf-8")


def read_sources(directory: Path) -> list[dict[str, Any]] | None:
    """What :func:`write_sources` wrote, or None (a processor of one dataset); one line naming the file when it is
    not what :func:`write_sources` writes (cut mid-write, or edited by hand)."""
    from loong.core.checkpoint.safetensors_io import read_json

    path = Path(directory) / SOURCES_FILE
    if not path.is_file():
        return None
    sources = read_json(path)
    entries = sources.get("sources") if isinstance(sources, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "root" in e and "name" in e
                                                for e in entries):
        raise LoongError(f"{path}: expected {{\"sources\": [{{\"root\": ..., \"name\": ..., \"embodiment_id\": ...}}, "
                         "...]}} (what training writes for a dataset mix)")
    return entries


def source_record(dataset: VLADataset, embodiment_id: int | None) -> dict[str, Any]:
    """One source's entry of ``sources.json``."""
    return {"root": str(dataset.root), "name": Path(dataset.root).name, "embodiment_id": embodiment_id}


__all__ = ["NEEDED_STATS", "SOURCES_FILE", "SOURCE_KEY", "Normalizer", "check_same_dims", "min_max_stats", "normalize_by_source", "read_sources",
           "source_index", "source_record", "write_sources"]


def source_bounds(source_stats: Sequence[Mapping[str, Mapping[str, torch.Tensor]]], key: str,
                  index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, dim]`` min and max of ``key`` for each sample's source ``index`` (GR00T's min-max normalisation of a
    mix: ``source_stats[i]`` is dataset ``i``'s statistics)."""
    lo = torch.stack([st[key]["min"] for st in source_stats])
    hi = torch.stack([st[key]["max"] for st in source_stats])
    return lo[index], hi[index]
