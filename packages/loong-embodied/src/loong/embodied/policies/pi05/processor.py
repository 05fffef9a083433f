"""Pi0.5's host side: raw LeRobot batches to model inputs, and normalised actions back to robot actions.

Steps, in lerobot 0.6.1's order (``make_pi05_pre_post_processors``): state and actions are normalised with
QUANTILES (``[q01, q99] -> [-1, 1]``, :class:`~loong.embodied.data.normalize.Normalizer`); the normalised state is
discretised into 256 bins and written into the prompt ``"Task: <task>, State: <bins>;\\nAction: "``
(``Pi05PrepareStateTokenizerProcessorStep``), which is tokenised right-padded to ``tokenizer_max_length``; each
camera is resized with centred black padding to ``image_size`` (openpi's ``resize_with_pad``) and scaled to
``[-1, 1]``; a camera missing from the batch (and each of ``empty_cameras``) is an all ``-1`` image with a false
mask; actions are zero-padded to ``max_action_dim`` and ``action_mask`` marks the real dims.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from loong.core.checkpoint.safetensors_io import read_json
from loong.core.errors import LoongError
from loong.embodied.data.normalize import (
    Normalizer,
    normalize_by_source,
    read_sources,
    source_index,
    source_record,
    write_sources,
)
from loong.embodied.policies.base import PolicyConfig, PolicyProcessor
from loong.embodied.policies.pi05.config import Pi05Config
from loong.embodied.policies.pi05.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from loong.embodied.data.dataset import VLADataset

#: Pi0.5 normalises state and actions by quantiles, leaves images alone (lerobot's ``PI05Config``)
NORM_MAP = {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}
PROCESSOR_FILE = "pi05_processor.json"
STATS_FILE = "pi05_stats.safetensors"
TOKENIZER_DIR = "tokenizer"


def source_stats_file(index: int) -> str:
    """The statistics file of a mix's source ``index`` >= 1 (source 0's is ``pi05_stats.safetensors``)."""
    return f"pi05_stats.{index}.safetensors"


def resize_with_pad(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """openpi's ``resize_with_pad`` of float ``[b, c, h, w]`` images in [0, 1]: bilinear resize keeping the aspect
    ratio, clamp to [0, 1], then centred zero padding to ``height x width``."""
    cur_h, cur_w = images.shape[-2:]
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    resized = F.interpolate(images, size=(new_h, new_w), mode="bilinear", align_corners=False).clamp(0.0, 1.0)
    top, extra_h = divmod(height - new_h, 2)
    left, extra_w = divmod(width - new_w, 2)
    return F.pad(resized, (left, left + extra_w, top, top + extra_h), mode="constant", value=0.0)


def discretize_state(state: np.ndarray) -> np.ndarray:
    """Normalised state ``[b, s]`` as bin indices 0..255 of ``[-1, 1]`` (values below -1 give -1, as lerobot)."""
    return np.digitize(state, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1


def pi05_prompt(task: str, bins: Sequence[int]) -> str:
    """The Pi0.5 prompt of one sample (lerobot's ``Pi05PrepareStateTokenizerProcessorStep``)."""
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(map(str, bins))};\nAction: "


class Pi05Processor(PolicyProcessor):
    """The Pi0.5 processor (see the module docstring).

    ``features``: lerobot dataset features (``meta/info.json`` entries) of ``camera_keys``, ``state_key`` and
    ``action_key``; ``stats``: their statistics (``meta/stats.json``; state and action need ``q01`` / ``q99``);
    ``tokenizer``: a loaded tokenizer (default: the one ``config.tokenizer`` names).
    """

    def __init__(self, config: Pi05Config, *, features: Mapping[str, Mapping[str, Any]],
                 stats: Mapping[str, Mapping[str, Any]] | None, camera_keys: Sequence[str],
                 state_key: str = "observation.state", action_key: str = "action",
                 tokenizer: PreTrainedTokenizerBase | None = None, source: str = "stats",
                 source_stats: Sequence[Mapping[str, Mapping[str, Any]] | None] = (),
                 sources: Sequence[Mapping[str, Any]] | None = None,
                 source_names: Sequence[str] = ()) -> None:
        self.config = config
        self.camera_keys = list(camera_keys)
        self.state_key, self.action_key = state_key, action_key
        for key in (*self.camera_keys, state_key, action_key):
            if key not in features:
                raise LoongError(f"pi05 processor: no feature '{key}' among {', '.join(features)}")
        self.features = {key: dict(features[key]) for key in (*self.camera_keys, state_key, action_key)}
        self.state_dim = int(self.features[state_key]["shape"][-1])
        self.action_dim = int(self.features[action_key]["shape"][-1])
        if self.action_dim > config.max_action_dim:
            raise LoongError(f"pi05.max_action_dim: {config.max_action_dim} is less than the action dim "
                             f"{self.action_dim} of '{action_key}'")
        if self.state_dim > config.max_state_dim:
            raise LoongError(f"pi05.max_state_dim: {config.max_state_dim} is less than the state dim "
                             f"{self.state_dim} of '{state_key}'")
        self.normalizer = Normalizer(stats, self.features, NORM_MAP, source=source)
        # a mix: sources 1.. normalise with their own statistics (source 0's are ``stats``); one action space
        names = list(source_names) or [f"source {i + 1}" for i in range(len(source_stats))]
        self.normalizers = [self.normalizer] + [Normalizer(st, self.features, NORM_MAP, source=names[i])
                                                for i, st in enumerate(source_stats)]
        self.sources = None if sources is None else [dict(r) for r in sources]
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)

    @classmethod
    def from_dataset(cls, config: PolicyConfig, dataset: VLADataset) -> Pi05Processor:
        """The processor of ``dataset``'s cameras, state and action with its ``meta/stats.json``."""
        assert isinstance(config, Pi05Config)
        keys = (*dataset.camera_keys, dataset.state_key, dataset.action_key)
        return cls(config, features={k: dataset.meta.features[k] for k in keys}, stats=dataset.stats,
                   camera_keys=dataset.camera_keys, state_key=dataset.state_key, action_key=dataset.action_key,
                   source=str(Path(dataset.root) / "meta" / "stats.json"))

    @classmethod
    def from_datasets(cls, config: PolicyConfig, datasets: Sequence[VLADataset],
                      embodiment_ids: Sequence[int] | None = None) -> Pi05Processor:
        """The processor of a mix: each sample normalised with its source's ``meta/stats.json`` (by the batch's
        ``dataset_index``). Pi0.5 has one action space: the datasets must agree on state and action dims."""
        first = cls.from_dataset(config, datasets[0])
        if len(datasets) == 1:
            return first
        for ds in datasets[1:]:
            if (ds.state_dim, ds.action_dim) != (first.state_dim, first.action_dim):
                raise LoongError(f"data.repo_root: Pi0.5 has one action space; {datasets[0].root} has state "
                                 f"{first.state_dim} / action {first.action_dim} dims, {ds.root} has state "
                                 f"{ds.state_dim} / action {ds.action_dim}: mix datasets of the same dims")
        ids = list(embodiment_ids) if embodiment_ids is not None else list(range(len(datasets)))
        return cls(config, features=first.features, stats=datasets[0].stats, camera_keys=first.camera_keys,
                   state_key=first.state_key, action_key=first.action_key, tokenizer=first.tokenizer,
                   source=str(Path(datasets[0].root) / "meta" / "stats.json"),
                   source_stats=[ds.stats for ds in datasets[1:]],
                   source_names=[str(Path(ds.root) / "meta" / "stats.json") for ds in datasets[1:]],
                   sources=[source_record(ds, i) for ds, i in zip(datasets, ids, strict=True)])

    # raw batch -> model inputs --------------------------------------------------------------------------------
    def prompts(self, tasks: Sequence[str], state: torch.Tensor) -> list[str]:
        """The prompts of a batch from its tasks and its *normalised* state ``[b, s]``."""
        bins = discretize_state(state.detach().cpu().numpy())
        return [pi05_prompt(task, bins[i]) for i, task in enumerate(tasks)]

    def images(self, batch: Mapping[str, Any], b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[b, n_cam, 3, S, S]`` images in [-1, 1] and ``[b, n_cam]`` masks (``S = config.image_size``)."""
        size = self.config.image_size
        present = [key for key in self.camera_keys if key in batch]
        if not present:
            raise LoongError(f"pi05 processor: the batch has none of the cameras {', '.join(self.camera_keys)}")
        images, masks = [], []
        for key in self.camera_keys:
            if key not in batch:
                images.append(torch.full((b, 3, size, size), -1.0))
                masks.append(torch.zeros(b, dtype=torch.bool))
                continue
            img = torch.as_tensor(batch[key])
            if img.dim() == 3:  # one observation
                img = img[None]
            if img.dim() == 4 and img.shape[1] != 3 and img.shape[-1] == 3:  # channels-last, as gym renders
                img = img.permute(0, 3, 1, 2)
            if img.dim() != 4 or img.shape[1] != 3 or img.shape[0] != b:
                raise LoongError(f"pi05 processor: camera '{key}' has shape {list(img.shape)}; expected "
                                 f"[{b}, 3, h, w] (floats in [0, 1] or uint8)")
            img = img.float() / 255.0 if img.dtype == torch.uint8 else img.float()
            if tuple(img.shape[-2:]) != (size, size):
                img = resize_with_pad(img, size, size)
            images.append(img * 2.0 - 1.0)
            masks.append(torch.ones(b, dtype=torch.bool))
        for _ in range(self.config.empty_cameras):
            images.append(torch.full((b, 3, size, size), -1.0))
            masks.append(torch.zeros(b, dtype=torch.bool))
        return torch.stack(images, dim=1), torch.stack(masks, dim=1)

    def __call__(self, batch: Mapping[str, Any], *, train: bool = True) -> dict[str, torch.Tensor]:
        """Model inputs: ``images``, ``image_masks``, ``tokens``, ``token_masks``, and with ``train`` ``actions``,
        ``action_mask`` and ``action_is_pad`` (see the module docstring)."""
        if self.state_key not in batch:
            raise LoongError(f"pi05 processor: the batch has no '{self.state_key}' (Pi0.5 writes the state into "
                             "its prompt)")
        if "task" not in batch:
            raise LoongError("pi05 processor: the batch has no 'task' (the instruction strings)")
        state = torch.as_tensor(batch[self.state_key]).float()
        if state.dim() == 1:
            state = state[None]
        b = state.shape[0]
        tasks = [batch["task"]] * b if isinstance(batch["task"], str) else list(batch["task"])
        if len(tasks) != b:
            raise LoongError(f"pi05 processor: {len(tasks)} tasks for a batch of {b}")
        to_normalize: dict[str, torch.Tensor] = {self.state_key: state}
        if train:
            if self.action_key not in batch:
                raise LoongError(f"pi05 processor: the batch has no '{self.action_key}' (needed for training)")
            to_normalize[self.action_key] = torch.as_tensor(batch[self.action_key]).float()
        index = source_index(batch, b, len(self.normalizers), "pi05 processor")
        normed = normalize_by_source(self.normalizers, to_normalize, index)
        encoded = self.tokenizer(self.prompts(tasks, normed[self.state_key]), max_length=self.config.tokenizer_max_length,
                                 truncation=True, padding="max_length", padding_side="right", return_tensors="pt")
        images, image_masks = self.images(batch, b)
        out = {"images": images, "image_masks": image_masks, "tokens": encoded["input_ids"].long(),
               "token_masks": encoded["attention_mask"].bool()}
        if train:
            actions = normed[self.action_key].float()
            if actions.shape[-1] != self.action_dim:
                raise LoongError(f"pi05 processor: '{self.action_key}' has {actions.shape[-1]} dims; the processor "
                                 f"was built for {self.action_dim}")
            out["actions"] = F.pad(actions, (0, self.config.max_action_dim - self.action_dim))
            mask = torch.zeros(b, self.config.max_action_dim, dtype=torch.bool)
            mask[:, : self.action_dim] = True
            out["action_mask"] = mask
            pad_key = f"{self.action_key}_is_pad"
            out["action_is_pad"] = (torch.as_tensor(batch[pad_key]).bool() if pad_key in batch
                                    else torch.zeros(actions.shape[:2], dtype=torch.bool))
        return out

    def postprocess(self, actions: torch.Tensor, source: int = 0) -> torch.Tensor:
        """Robot actions ``[..., action_dim]``: the real dims, unnormalised with source ``source``'s statistics
        (a mix's dataset index; 0 for a policy of one dataset)."""
        if not 0 <= source < len(self.normalizers):
            raise LoongError(f"pi05 processor: source {source} is not one of its {len(self.normalizers)} datasets")
        return self.normalizers[source].unnormalize_action(actions[..., : self.action_dim].float().cpu())

    # persistence ----------------------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """``pi05_processor.json`` (keys and features), ``pi05_stats.safetensors``, ``tokenizer/``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"camera_keys": self.camera_keys, "state_key": self.state_key, "action_key": self.action_key,
                "features": self.features}
        (directory / PROCESSOR_FILE).write_text(json.dumps(meta, indent=2, default=list), encoding="utf-8")
        flat = {f"{key}/{name}": torch.as_tensor(np.asarray(value)).contiguous()
                for key, stats in self.normalizer.stats.items() for name, value in stats.items()}
        save_file(flat, str(directory / STATS_FILE))
        if self.sources is not None:  # a mix: source i >= 1 in pi05_stats.<i>.safetensors, and which is which
            for i, normalizer in enumerate(self.normalizers[1:], start=1):
                save_file({f"{key}/{name}": torch.as_tensor(np.asarray(value)).contiguous()
                           for key, stats in normalizer.stats.items() for name, value in stats.items()},
                          str(directory / source_stats_file(i)))
            write_sources(directory, self.sources)
        self.tokenizer.save_pretrained(str(directory / TOKENIZER_DIR))

    @classmethod
    def load(cls, directory: Path, config: PolicyConfig) -> Pi05Processor:
        """The processor :meth:`save` wrote into ``directory``."""
        from safetensors.torch import load_file

        assert isinstance(config, Pi05Config)
        directory = Path(directory)
        meta_path = directory / PROCESSOR_FILE
        if not meta_path.is_file():
            raise LoongError(f"{directory}: no {PROCESSOR_FILE} (not a saved Pi0.5 processor)")
        meta = read_json(meta_path)

        def read_stats(path: Path) -> dict[str, dict[str, Any]]:
            stats: dict[str, dict[str, Any]] = {}
            if path.is_file():
                for name, value in load_file(str(path)).items():
                    key, stat = name.rsplit("/", 1)
                    stats.setdefault(key, {})[stat] = value.numpy()
            return stats

        sources = read_sources(directory)
        extra = [] if sources is None else [directory / source_stats_file(i) for i in range(1, len(sources))]
        tokenizer = load_tokenizer(str(directory / TOKENIZER_DIR))
        return cls(config, features=meta["features"], stats=read_stats(directory / STATS_FILE),
                   camera_keys=meta["camera_keys"], state_key=meta["state_key"], action_key=meta["action_key"],
                   tokenizer=tokenizer, source=str(directory / STATS_FILE),
                   source_stats=[read_stats(p) for p in extra], source_names=[str(p) for p in extra],
                   sources=sources)


__all__ = ["NORM_MAP", "Pi05Processor", "discretize_state", "pi05_prompt", "resize_with_pad"]
