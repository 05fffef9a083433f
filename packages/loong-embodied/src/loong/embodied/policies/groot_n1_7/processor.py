"""GR00T N1.7's host side: what lerobot 0.6.1's ``GrootN17PackInputsStep`` + ``GrootN17VLMEncodeStep`` do.

Per raw batch (``collate_vla``)::

    cameras (sorted keys) float [b, 3, h, w] in [0, 1] -> uint8 -> resize to target (bicubic, antialiased),
        centre crop by crop/target, resize back to target -> Qwen3-VL image processor (patches + grid)
    task -> lower-cased, only letters/digits/spaces/_ kept -> one user turn: all images, then the text, through
        the processor's chat template; tokens left-padded
    state -> GR00T min-max to [-1, 1] (a constant feature -> 0; clipped) -> zero-padded to max_state_dim,
        [b, 1, max_state_dim]
    action -> the same min-max -> zero-padded to [b, chunk_size, max_action_dim]; ``action_mask`` 1 on the real
        dims of the non-padded steps (``action_is_pad``), padded steps zeroed
    embodiment_id -> the batch's, or the config's embodiment tag's id (refused outside [0, num_embodiments))
    input_ids / image_grid_thw -> the backbone's index tensors (:mod:`.precompute`: M-RoPE ids, the vision tower's
        rotary ids, pos-embed taps and image boundaries, the image tokens' flat positions), so that the policy's
        device step reads nothing back from the device

``postprocess`` inverts the action normalisation on the real dims (clipped to [-1, 1] first, as lerobot's
``GrootActionUnpackUnnormalizeStep``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from loong.core.checkpoint.safetensors_io import read_json
from loong.core.errors import LoongError
from loong.embodied.data.normalize import (
    check_same_dims,
    min_max_stats,
    read_sources,
    source_bounds,
    source_index,
    source_record,
    write_sources,
)
from loong.embodied.policies.base import PolicyConfig, PolicyProcessor
from loong.embodied.policies.groot.embodiment import check_embodiment_ids
from loong.embodied.policies.groot_n1_7 import precompute as pre
from loong.embodied.policies.groot_n1_7.config import GrootN17Config

if TYPE_CHECKING:
    from loong.embodied.data.dataset import VLADataset

PROCESSOR_FILE = "groot_n1_7_processor.json"
VLM_PROCESSOR_DIR = "qwen3_vl_processor"
DEFAULT_TASK = "Perform the task."


def formalize_language(text: str) -> str:
    """GR00T's instruction normalisation: lower case, keep letters, digits, whitespace and ``_``."""
    text = text.lower()
    return "".join(ch for ch in text if ch.isalnum() or ch.isspace() or ch == "_")


def min_max_normalize(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, *, clip: bool = True) -> torch.Tensor:
    """``2 (x - lo) / (hi - lo) - 1``; 0 where ``hi == lo``; clipped to [-1, 1] when ``clip``."""
    denom = hi - lo
    ok = denom != 0
    out = 2 * (x - lo) / torch.where(ok, denom, torch.ones_like(denom)) - 1
    out = torch.where(ok, out, torch.zeros_like(out))
    return out.clamp(-1.0, 1.0) if clip else out


def min_max_unnormalize(y: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`min_max_normalize` (``lo`` where ``hi == lo``)."""
    denom = hi - lo
    ok = denom != 0
    x = (y + 1.0) * 0.5 * torch.where(ok, denom, torch.ones_like(denom)) + lo
    return torch.where(ok, x, lo)


def transform_image(image: torch.Tensor, target: Sequence[int], crop: Sequence[int] | None) -> torch.Tensor:
    """GR00T N1.7's eval image geometry on a ``[3, h, w]`` uint8 image: resize to ``target`` (square, bicubic,
    antialiased), centre crop by ``crop[0] / target[0]`` (size rounded, offset floored), resize to ``target``."""
    import torchvision.transforms.v2.functional as tvf
    from torchvision.transforms import InterpolationMode

    th, tw = int(target[0]), int(target[1])
    image = tvf.resize(image, [th, th], interpolation=InterpolationMode.BICUBIC, antialias=True)
    if crop is not None:
        fraction = crop[0] / float(th)
        if 0.0 < fraction < 1.0:
            ch = max(1, int(round(image.shape[-2] * fraction)))
            cw = max(1, int(round(image.shape[-1] * fraction)))
            top = max(0, (image.shape[-2] - ch) // 2)
            left = max(0, (image.shape[-1] - cw) // 2)
            image = image[..., top: top + ch, left: left + cw]
    if tuple(image.shape[-2:]) != (th, tw):
        image = tvf.resize(image, [th, tw], interpolation=InterpolationMode.BICUBIC, antialias=True)
    return image


def load_vlm_processor(path: str | Path):
    """A Qwen3-VL processor from a local folder (the tokenizer must carry the chat template), left padding."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    path = Path(path)
    if not path.is_dir():
        raise LoongError(f"groot_n1_7.processor: {path} is not a folder (it must hold a Qwen3-VL processor, e.g. "
                         "nvidia/Cosmos-Reason2-2B's tokenizer and preprocessor_config.json)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
        image = Qwen2VLImageProcessor.from_pretrained(str(path))
        video = Qwen3VLVideoProcessor.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise LoongError(f"groot_n1_7.processor: {path}: cannot load a Qwen3-VL processor ({e})") from e
    if not tok.chat_template:
        raise LoongError(f"groot_n1_7.processor: {path}: the tokenizer has no chat_template")
    proc = Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=video,
                            chat_template=tok.chat_template)
    proc.tokenizer.padding_side = "left"
    return proc


class GrootN17Processor(PolicyProcessor):
    """Raw batches -> GR00T N1.7 model inputs (see the module docstring); holds stats and the VLM processor.

    ``stats``: ``{state_key: {"min", "max"}, action_key: {"min", "max"}}`` (a dataset's ``meta/stats.json``);
    ``vlm_processor``: a ``Qwen3VLProcessor``, or None to load ``config.processor`` (the ``tiny`` preset's
    in-package processor when that is None too and the backbone is the tiny one).
    """

    def __init__(self, config: GrootN17Config, *, stats: Mapping[str, Mapping[str, Any]],
                 camera_keys: Sequence[str], state_key: str = "observation.state", action_key: str = "action",
                 vlm_processor: Any = None, source: str = "stats",
                 source_stats: Sequence[Mapping[str, Mapping[str, Any]]] = (),
                 sources: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.config = config
        self.camera_keys = sorted(camera_keys)
        if not self.camera_keys:
            raise LoongError("groot_n1_7 processor: no cameras (GR00T needs at least one image feature)")
        self.state_key, self.action_key = state_key, action_key
        self.stats: dict[str, dict[str, torch.Tensor]] = {}
        for key in (state_key, action_key):
            have = stats.get(key) if stats is not None else None
            if have is None or "min" not in have or "max" not in have:
                raise LoongError(f"{source}: '{key}' needs min and max statistics (GR00T min-max normalisation); "
                                 f"it has: {', '.join(have or []) or 'nothing'}")
            self.stats[key] = {n: torch.as_tensor(have[n], dtype=torch.float32).flatten() for n in ("min", "max")}
        self.state_dim = int(self.stats[state_key]["min"].numel())
        self.action_dim = int(self.stats[action_key]["min"].numel())
        # a mix: per source (0 = ``stats``) its min/max, stacked [num_sources, dim] and picked per sample
        self.sources = None if sources is None else [dict(r) for r in sources]
        self.source_stats = [self.stats] + [min_max_stats(st, (state_key, action_key), f"source {i + 1}",
                                                          (self.state_dim, self.action_dim))
                                            for i, st in enumerate(source_stats)]
        if self.state_dim > config.max_state_dim or self.action_dim > config.max_action_dim:
            raise LoongError(f"groot_n1_7 processor: state dim {self.state_dim} / action dim {self.action_dim} "
                             f"exceed max_state_dim {config.max_state_dim} / max_action_dim {config.max_action_dim}")
        if vlm_processor is None:
            if config.processor is not None:
                vlm_processor = load_vlm_processor(config.processor)
            else:
                from loong.embodied.policies.groot_n1_7.tiny_processor import build_tiny_processor

                if config.backbone is None:
                    raise LoongError("groot_n1_7.processor: not set; name a local folder with the Qwen3-VL "
                                     "processor of nvidia/Cosmos-Reason2-2B (the hub is not used)")
                vlm_processor = build_tiny_processor()
        self.vlm = vlm_processor
        self.geometry = pre.BackboneGeometry.of_backbone_dict(config.backbone_dict())

    @classmethod
    def from_dataset(cls, dataset: VLADataset, config: PolicyConfig) -> GrootN17Processor:
        """The processor of ``dataset``'s cameras, state and action with its ``meta/stats.json``."""
        if isinstance(dataset, PolicyConfig):  # accept (config, dataset) too
            dataset, config = config, dataset  # type: ignore[assignment]
        assert isinstance(config, GrootN17Config)
        return cls(config, stats=dataset.stats, camera_keys=dataset.camera_keys, state_key=dataset.state_key,
                   action_key=dataset.action_key, source=str(Path(dataset.root) / "meta" / "stats.json"))

    @classmethod
    def from_datasets(cls, config: PolicyConfig, datasets: Sequence[VLADataset],
                      embodiment_ids: Sequence[int] | None = None) -> GrootN17Processor:
        """The processor of a mix: each sample min-max normalised with its source's statistics (the batch's
        ``dataset_index``) and, where the batch carries no ``embodiment_id``, its source's embodiment id."""
        first = cls.from_dataset(datasets[0], config)
        if len(datasets) == 1 and embodiment_ids is None:
            return first
        check_same_dims(datasets, "groot_n1_7")
        ids = list(embodiment_ids) if embodiment_ids is not None else list(range(len(datasets)))
        return cls(config, stats=datasets[0].stats, camera_keys=first.camera_keys, state_key=first.state_key,
                   action_key=first.action_key, vlm_processor=first.vlm,
                   source_stats=[ds.stats for ds in datasets[1:]],
                   sources=[source_record(ds, i) for ds, i in zip(datasets, ids, strict=True)])

    def bounds(self, key: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[b, dim]`` min and max of ``key`` for each sample's source ``index``."""
        return source_bounds(self.source_stats, key, index)

    def embodiment_ids(self, batch: Mapping[str, Any], index: torch.Tensor, b: int) -> torch.Tensor:
        """``[b]``: the batch's ``embodiment_id``, else each source's (a mix), else the config's."""
        emb = batch.get("embodiment_id")
        if emb is not None:
            return torch.as_tensor(emb, dtype=torch.long).reshape(b)
        if self.sources is not None:
            return torch.tensor([self.sources[i]["embodiment_id"] for i in index.tolist()], dtype=torch.long)
        return torch.full((b,), self.config.embodiment_id, dtype=torch.long)

    # raw batch -> model inputs --------------------------------------------------------------------------------
    def tasks(self, batch: Mapping[str, Any], b: int) -> list[str]:
        tasks = batch.get("task")
        if tasks is None or isinstance(tasks, str):
            tasks = [tasks or DEFAULT_TASK] * b
        tasks = [str(t) if t else DEFAULT_TASK for t in tasks]
        if len(tasks) != b:
            raise LoongError(f"groot_n1_7 processor: {len(tasks)} tasks for a batch of {b}")
        return [formalize_language(t) if self.config.formalize_language else t for t in tasks]

    def frames(self, batch: Mapping[str, Any], b: int) -> list[list[torch.Tensor]]:
        """Per sample, its cameras' transformed ``[3, H, W]`` uint8 frames, in camera order."""
        missing = [k for k in self.camera_keys if k not in batch]
        if missing:
            raise LoongError(f"groot_n1_7 processor: the batch lacks camera(s) {', '.join(missing)}")
        per_camera = []
        for key in self.camera_keys:
            img = torch.as_tensor(batch[key])
            if img.dim() != 4 or img.shape[1] != 3 or img.shape[0] != b:
                raise LoongError(f"groot_n1_7 processor: camera '{key}' has shape {list(img.shape)}; expected "
                                 f"[{b}, 3, h, w]")
            if img.dtype.is_floating_point:
                img = (img.clamp(0, 1) * 255.0).to(torch.uint8)
            per_camera.append(img.cpu())
        crop = self.config.image_crop_size
        return [[transform_image(cam[i], self.config.image_target_size, crop) for cam in per_camera]
                for i in range(b)]

    def __call__(self, batch: Mapping[str, Any], *, train: bool = True) -> dict[str, torch.Tensor]:
        c = self.config
        if self.state_key not in batch:
            raise LoongError(f"groot_n1_7 processor: the batch has no '{self.state_key}'")
        state = torch.as_tensor(batch[self.state_key]).float().cpu()
        if state.dim() != 2 or state.shape[1] != self.state_dim:
            raise LoongError(f"groot_n1_7 processor: '{self.state_key}' has shape {list(state.shape)}; expected "
                             f"[b, {self.state_dim}]")
        b = state.shape[0]
        frames = self.frames(batch, b)
        texts, images = [], []
        for sample_frames, task in zip(frames, self.tasks(batch, b), strict=True):
            turn = [{"role": "user", "content": [*({"type": "image", "image": f} for f in sample_frames),
                                                 {"type": "text", "text": task}]}]
            texts.append(self.vlm.apply_chat_template(turn, tokenize=False, add_generation_prompt=False))
            images.extend(sample_frames)
        encoded = self.vlm(text=texts, images=images, return_tensors="pt", padding=True)
        out: dict[str, torch.Tensor] = {k: v for k, v in encoded.items() if isinstance(v, torch.Tensor)}
        where = "groot_n1_7 processor"
        pre.check_one_image_size(out["image_grid_thw"], where)
        out.update(pre.precompute(out["input_ids"], out.get("attention_mask"), out.get("mm_token_type_ids"),
                                  out["image_grid_thw"], self.geometry, where=where))

        index = source_index(batch, b, len(self.source_stats), "groot_n1_7 processor")
        lo, hi = self.bounds(self.state_key, index)
        state = min_max_normalize(state, lo, hi, clip=c.clip_outliers)
        out["state"] = torch.nn.functional.pad(state, (0, c.max_state_dim - self.state_dim)).unsqueeze(1)
        out["embodiment_id"] = self.embodiment_ids(batch, index, b)
        check_embodiment_ids(out["embodiment_id"], c.num_embodiments, where)
        if train or self.action_key in batch:
            out.update(self.actions(batch, b, index))
        return out

    def actions(self, batch: Mapping[str, Any], b: int,
                index: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``action`` ``[b, chunk, max_action_dim]`` (normalised, padded steps zeroed) and ``action_mask``."""
        c = self.config
        if self.action_key not in batch:
            raise LoongError(f"groot_n1_7 processor: the batch has no '{self.action_key}' (train=True)")
        action = torch.as_tensor(batch[self.action_key]).float().cpu()
        if action.dim() == 2:
            action = action.unsqueeze(1)
        if action.dim() != 3 or action.shape[0] != b or action.shape[2] != self.action_dim:
            raise LoongError(f"groot_n1_7 processor: '{self.action_key}' has shape {list(action.shape)}; expected "
                             f"[{b}, chunk, {self.action_dim}]")
        horizon = action.shape[1]
        if horizon > c.chunk_size:
            raise LoongError(f"groot_n1_7 processor: action chunk of {horizon} steps exceeds chunk_size "
                             f"{c.chunk_size}")
        if index is None:
            index = source_index(batch, b, len(self.source_stats), "groot_n1_7 processor")
        lo, hi = self.bounds(self.action_key, index)
        action = min_max_normalize(action, lo.unsqueeze(1), hi.unsqueeze(1), clip=c.clip_outliers)
        action = torch.nn.functional.pad(action, (0, c.max_action_dim - self.action_dim, 0, c.chunk_size - horizon))
        valid = torch.zeros(b, c.chunk_size, dtype=torch.bool)
        valid[:, :horizon] = True
        is_pad = batch.get(f"{self.action_key}_is_pad")
        if is_pad is not None:
            is_pad = torch.as_tensor(is_pad, dtype=torch.bool).reshape(b, -1)
            n = min(c.chunk_size, is_pad.shape[1])
            valid[:, :n] &= ~is_pad[:, :n]
        action = action * valid.unsqueeze(-1).to(action.dtype)
        mask = torch.zeros(b, c.chunk_size, c.max_action_dim)
        mask[:, :, : self.action_dim] = valid.unsqueeze(-1).float()
        return {"action": action, "action_mask": mask}

    def postprocess(self, actions: torch.Tensor, source: int = 0) -> torch.Tensor:
        """Robot actions ``[..., action_dim]``: the real dims, clipped to [-1, 1], min-max inverted with source
        ``source``'s statistics (a mix's dataset index; 0 for one dataset)."""
        if not 0 <= source < len(self.source_stats):
            raise LoongError(f"groot_n1_7 processor: source {source} is not one of its {len(self.source_stats)} "
                             "datasets")
        a = self.source_stats[source][self.action_key]
        y = actions[..., : self.action_dim].float().cpu().clamp(-1.0, 1.0)
        return min_max_unnormalize(y, a["min"], a["max"])

    # persistence ----------------------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """``groot_n1_7_processor.json`` (keys and min/max statistics) and ``qwen3_vl_processor/``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"camera_keys": self.camera_keys, "state_key": self.state_key, "action_key": self.action_key,
                "stats": {k: {n: v.tolist() for n, v in s.items()} for k, s in self.stats.items()}}
        if self.sources is not None:  # a mix: sources 1.. after source 0's ``stats``, and which is which
            meta["source_stats"] = [{k: {n: v.tolist() for n, v in s.items()} for k, s in st.items()}
                                    for st in self.source_stats[1:]]
            write_sources(directory, self.sources)
        (directory / PROCESSOR_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        vlm_dir = directory / VLM_PROCESSOR_DIR
        self.vlm.save_pretrained(str(vlm_dir))
        self.vlm.tokenizer.save_pretrained(str(vlm_dir))
        self.vlm.image_processor.save_pretrained(str(vlm_dir))
        self.vlm.video_processor.save_pretrained(str(vlm_dir))

    @classmethod
    def load(cls, directory: Path, config: PolicyConfig) -> GrootN17Processor:
        """The processor :meth:`save` wrote into ``directory``."""
        assert isinstance(config, GrootN17Config)
        directory = Path(directory)
        meta_path = directory / PROCESSOR_FILE
        if not meta_path.is_file():
            raise LoongError(f"{directory}: no {PROCESSOR_FILE} (not a saved GR00T N1.7 processor)")
        meta = read_json(meta_path)
        return cls(config, stats=meta["stats"], camera_keys=meta["camera_keys"], state_key=meta["state_key"],
                   action_key=meta["action_key"], vlm_processor=load_vlm_processor(directory / VLM_PROCESSOR_DIR),
                   source=str(meta_path), source_stats=meta.get("source_stats", []),
                   sources=read_sources(directory))


__all__ = ["GrootN17Processor", "formalize_language", "load_vlm_processor", "min_max_normalize",
           "min_max_unnormalize", "transform_image"]
