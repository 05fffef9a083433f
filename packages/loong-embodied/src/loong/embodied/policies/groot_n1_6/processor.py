"""GR00T N1.6's processor: the Eagle prompt with image-token runs, resized images, min-max state/action, embodiment.

What Isaac-GR00T's ``Gr00tN1d6Processor`` + Eagle3 processor do, for LeRobot batches (facts from
``processing_gr00t_n1d6.py`` and ``Eagle-Block2A-2B-v2/processing_eagle3_vl.py``)::

    language    lower-cased, punctuation removed (formalize_language)
    prompt      <|im_start|>system\\nYou are a helpful assistant.\\n<|im_end|>\\n<|im_start|>user\\n{language}
                then per camera i: <image {i}><img><IMG_CONTEXT> * tokens_per_image</img>, then <|im_end|>\\n
                (the user turn holds the text first and the images after it; each ``<image-i>`` placeholder
                becomes a run of ``H * W / 28**2`` image tokens), left-padded to ``tokenizer_max_length``
    images      resized to ``image_size`` (bilinear, antialiased; Isaac-GR00T resizes with cv2 INTER_AREA then
                PIL), scaled to [-1, 1] (the Eagle3 image processor's mean = std = 0.5, no resize of its own)
    state       min-max to [-1, 1] with the dataset's min/max, clipped, a zero-range dim -> 0; zero-padded to
                max_state_dim (lerobot's GR00T processor / Isaac-GR00T's StateActionProcessor arithmetic)
    action      the same, padded to max_action_dim; action_mask is 1 on real dims of non-padded steps
    embodiment  the batch's ``embodiment_id`` when given (multi-dataset mixes), else the config's embodiment's row
    precomputed image_token_index (the image tokens' flat positions) and vision_pos_weights (the SigLIP2 position
                table's resize to the image grid): :mod:`.precompute`, so that the training step reads nothing back
                from the device; the image-token count per sample and the embodiment ids' range are checked here

Left padding shifts every real token's RoPE position by the same amount, which leaves attention unchanged, so a
fixed length gives the features Isaac-GR00T's pad-to-longest does, with static shapes.
The tiny tokenizer is word-level, built in-process from the prompt's fixed words and the synthetic reach task's
instructions (shipped text), with the Eagle special tokens at ids 0..5 (``<IMG_CONTEXT>`` = 5 = tiny's
``image_token_id``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

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
from loong.embodied.policies.groot_n1_6 import precompute as pre
from loong.embodied.policies.groot_n1_6.config import TINY_TOKENIZER, GrootN16Config
from loong.embodied.policies.word_tokenizer import reach_vocabulary, word_level_backend

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from loong.embodied.data.dataset import VLADataset

IMAGE_TOKEN = "<IMG_CONTEXT>"
IMAGE_START, IMAGE_END = "<img>", "</img>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_START, IMAGE_END, IMAGE_TOKEN)
PROMPT_WORDS = ("system", "user", "You", "are", "a", "helpful", "assistant", ".", "<", ">", "image",
                *(str(i) for i in range(10)))
SYSTEM_TURN = "<|im_start|>system\nYou are a helpful assistant.\n<|im_end|>\n"
PROCESSOR_FILE = "groot_n1_6_processor.json"
TOKENIZER_DIR = "tokenizer"


# --- tokenizer ---------------------------------------------------------------------------------------------------
def tiny_vocabulary() -> list[str]:
    """The tiny tokenizer's tokens in id order (see the module docstring)."""
    return reach_vocabulary([*SPECIAL_TOKENS, "<unk>", *PROMPT_WORDS], formalize)


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """The built-in word-level tokenizer (Eagle's special tokens split out before the whitespace split)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=word_level_backend(tiny_vocabulary()), pad_token="<|endoftext|>",
                                   unk_token="<unk>", additional_special_tokens=list(SPECIAL_TOKENS[1:]))


def load_tokenizer(name: str | None) -> PreTrainedTokenizerBase:
    """``"builtin:tiny"`` or a local tokenizer folder (the Eagle-Block2A-2B-v2 / Qwen3 one; never the Hub)."""
    if name == TINY_TOKENIZER:
        return tiny_tokenizer()
    if not name or not Path(name).expanduser().is_dir():
        raise LoongError(f"groot_n1_6.tokenizer: {name!r} is not a local folder; give the Eagle-Block2A-2B-v2 "
                         f"tokenizer folder (Isaac-GR00T gr00t/model/modules/nvidia/Eagle-Block2A-2B-v2) or "
                         f"{TINY_TOKENIZER!r}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(name).expanduser()), local_files_only=True)


# --- text and numbers --------------------------------------------------------------------------------------------
def formalize(language: str) -> str:
    """Isaac-GR00T's ``formalize_language``: lower case, every non-word non-space character removed."""
    return re.sub(r"[^\w\s]", "", language.lower())


def eagle_prompt(language: str, num_images: int, tokens_per_image: int) -> str:
    """The Eagle chat prompt of one sample (see the module docstring)."""
    images = "".join(f"<image {i + 1}>{IMAGE_START}{IMAGE_TOKEN * tokens_per_image}{IMAGE_END}"
                      for i in range(num_images))
    return f"{SYSTEM_TURN}<|im_start|>user\n{language}{images}<|im_end|>\n"


def min_max_normalize(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """``[low, high] -> [-1, 1]``, clipped; a dimension with ``high == low`` maps to 0 (GR00T's arithmetic)."""
    span = high - low
    valid = span != 0
    mapped = 2 * (x - low) / torch.where(valid, span, torch.ones_like(span)) - 1
    return torch.where(valid, mapped, torch.zeros_like(mapped)).clamp(-1.0, 1.0)


def min_max_unnormalize(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`min_max_normalize` (input clipped to [-1, 1] first)."""
    return (x.clamp(-1.0, 1.0) + 1.0) * 0.5 * (high - low) + low


class GrootN16Processor(PolicyProcessor):
    """Raw LeRobot batches -> GR00T N1.6 model inputs (see the module docstring for each key).

    ``features``: lerobot dataset features of ``camera_keys``, ``state_key``, ``action_key``; ``stats``: their
    ``meta/stats.json`` entries (state and action need ``min`` / ``max``); ``tokenizer``: a loaded tokenizer
    (default: the one ``config.tokenizer`` names).
    """

    def __init__(self, config: GrootN16Config, *, features: Mapping[str, Mapping[str, Any]],
                 stats: Mapping[str, Mapping[str, Any]] | None, camera_keys: Sequence[str],
                 state_key: str = "observation.state", action_key: str = "action",
                 tokenizer: PreTrainedTokenizerBase | None = None, source: str = "stats",
                 source_stats: Sequence[Mapping[str, Mapping[str, Any]]] = (),
                 sources: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.config = config
        self.camera_keys = list(camera_keys)
        if not self.camera_keys:
            raise LoongError("groot_n1_6 processor: no cameras (GR00T N1.6 needs at least one image)")
        self.state_key, self.action_key = state_key, action_key
        for key in (*self.camera_keys, state_key, action_key):
            if key not in features:
                raise LoongError(f"groot_n1_6 processor: no feature '{key}' among {', '.join(features)}")
        self.features = {key: dict(features[key]) for key in (*self.camera_keys, state_key, action_key)}
        self.state_dim = int(self.features[state_key]["shape"][-1])
        self.action_dim = int(self.features[action_key]["shape"][-1])
        for what, dim, limit in (("state", self.state_dim, config.max_state_dim),
                                 ("action", self.action_dim, config.max_action_dim)):
            if dim > limit:
                raise LoongError(f"groot_n1_6.max_{what}_dim: {limit} is less than the {what} dim {dim}")
        self.stats: dict[str, dict[str, torch.Tensor]] = {}
        for key, dim in ((state_key, self.state_dim), (action_key, self.action_dim)):
            have = (stats or {}).get(key)
            if have is None or "min" not in have or "max" not in have:
                raise LoongError(f"{source}: '{key}' needs 'min' and 'max' statistics (GR00T normalises by min-max);"
                                 f" it has: {', '.join(have) if have else 'nothing'}")
            low = torch.as_tensor(np.asarray(have["min"], dtype=np.float32)).reshape(-1)
            high = torch.as_tensor(np.asarray(have["max"], dtype=np.float32)).reshape(-1)
            if low.numel() != dim or high.numel() != dim:
                raise LoongError(f"{source}: '{key}' min/max have {low.numel()}/{high.numel()} values; the feature "
                                 f"has {dim} dims")
            self.stats[key] = {"min": low, "max": high}
        # a mix: per source (0 = ``stats``) its min/max, picked per sample by the batch's ``dataset_index``
        self.sources = None if sources is None else [dict(r) for r in sources]
        self.source_stats = [self.stats] + [min_max_stats(st, (state_key, action_key), f"source {i + 1}",
                                                          (self.state_dim, self.action_dim))
                                            for i, st in enumerate(source_stats)]
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)
        image_id = self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if image_id != config.image_token_id:
            raise LoongError(f"groot_n1_6.image_token_id: {config.image_token_id}, but the tokenizer maps "
                             f"{IMAGE_TOKEN} to {image_id}")
        # every camera is resized to image_size, so one resize matrix serves every image of every batch
        self.pos_weights = pre.position_resize_weights(pre.patch_grid(config.image_size, config.patch_size),
                                                       config.vision_num_patches)

    @classmethod
    def from_dataset(cls, config: PolicyConfig, dataset: VLADataset) -> GrootN16Processor:
        """The processor of ``dataset``'s cameras, state and action with its ``meta/stats.json``."""
        assert isinstance(config, GrootN16Config)
        keys = (*dataset.camera_keys, dataset.state_key, dataset.action_key)
        return cls(config, features={k: dataset.meta.features[k] for k in keys}, stats=dataset.stats,
                   camera_keys=dataset.camera_keys, state_key=dataset.state_key, action_key=dataset.action_key,
                   source=str(Path(dataset.root) / "meta" / "stats.json"))

    @classmethod
    def from_datasets(cls, config: PolicyConfig, datasets: Sequence[VLADataset],
                      embodiment_ids: Sequence[int] | None = None) -> GrootN16Processor:
        """The processor of a mix: each sample min-max normalised with its source's statistics (the batch's
        ``dataset_index``) and, where the batch carries no ``embodiment_id``, its source's embodiment id."""
        first = cls.from_dataset(config, datasets[0])
        if len(datasets) == 1 and embodiment_ids is None:
            return first
        check_same_dims(datasets, "groot_n1_6")
        ids = list(embodiment_ids) if embodiment_ids is not None else list(range(len(datasets)))
        return cls(config, features=first.features, stats=datasets[0].stats, camera_keys=first.camera_keys,
                   state_key=first.state_key, action_key=first.action_key, tokenizer=first.tokenizer,
                   source_stats=[ds.stats for ds in datasets[1:]],
                   sources=[source_record(ds, i) for ds, i in zip(datasets, ids, strict=True)])

    def bounds(self, key: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[b, dim]`` min and max of ``key`` for each sample's source ``index``."""
        return source_bounds(self.source_stats, key, index)

    # raw batch -> model inputs --------------------------------------------------------------------------------
    def prompts(self, tasks: Sequence[str]) -> list[str]:
        """The Eagle prompts of a batch's instructions."""
        c = self.config
        return [eagle_prompt(formalize(t) if c.formalize_language else t, len(self.camera_keys), c.tokens_per_image)
                for t in tasks]

    def images(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """``[b, cameras, 3, H, W]`` in [-1, 1] (``(H, W) = config.image_size``)."""
        out = []
        for key in self.camera_keys:
            if key not in batch:
                raise LoongError(f"groot_n1_6 processor: the batch lacks camera '{key}'")
            img = torch.as_tensor(batch[key])
            if img.dim() == 3:
                img = img[None]
            if img.dim() != 4 or img.shape[1] != 3:
                raise LoongError(f"groot_n1_6 processor: camera '{key}' has shape {list(img.shape)}; expected "
                                 "[b, 3, h, w] in [0, 1]")
            img = img.float() / 255.0 if img.dtype == torch.uint8 else img.float()
            if tuple(img.shape[-2:]) != self.config.image_size:
                img = F.interpolate(img, size=self.config.image_size, mode="bilinear", align_corners=False,
                                    antialias=True).clamp(0.0, 1.0)
            out.append(img * 2.0 - 1.0)
        return torch.stack(out, dim=1)

    def __call__(self, batch: Mapping[str, Any], *, train: bool = True) -> dict[str, torch.Tensor]:
        """Model inputs: ``input_ids``, ``attention_mask``, ``pixel_values``, ``state``, ``embodiment_id``, the
        :data:`~.precompute.PRECOMPUTED_KEYS` tensors and, with ``train``, ``action`` and ``action_mask``."""
        c = self.config
        if self.state_key not in batch:
            raise LoongError(f"groot_n1_6 processor: the batch has no '{self.state_key}'")
        if "task" not in batch:
            raise LoongError("groot_n1_6 processor: the batch has no 'task' (the instruction strings)")
        state = torch.as_tensor(batch[self.state_key]).float()
        if state.dim() == 1:
            state = state[None]
        b = state.shape[0]
        if state.shape[-1] != self.state_dim:
            raise LoongError(f"groot_n1_6 processor: '{self.state_key}' has {state.shape[-1]} dims; the processor "
                             f"was built for {self.state_dim}")
        tasks = [batch["task"]] * b if isinstance(batch["task"], str) else list(batch["task"])
        if len(tasks) != b:
            raise LoongError(f"groot_n1_6 processor: {len(tasks)} tasks for a batch of {b}")
        prompts = self.prompts(tasks)
        encoded = self.tokenizer(prompts, padding="max_length", max_length=c.tokenizer_max_length,
                                 padding_side="left", truncation=False, add_special_tokens=False, return_tensors="pt")
        if encoded["input_ids"].shape[1] > c.tokenizer_max_length:
            raise LoongError(f"groot_n1_6.tokenizer_max_length: {c.tokenizer_max_length} is shorter than a prompt of "
                             f"{encoded['input_ids'].shape[1]} tokens ({len(self.camera_keys)} cameras x "
                             f"{c.tokens_per_image} image tokens + text); raise it")
        index = source_index(batch, b, len(self.source_stats), "groot_n1_6 processor")
        lo, hi = self.bounds(self.state_key, index)
        out = {"input_ids": encoded["input_ids"].long(), "attention_mask": encoded["attention_mask"].long(),
               "pixel_values": self.images(batch),
               "state": F.pad(min_max_normalize(state, lo, hi), (0, c.max_state_dim - self.state_dim))}
        if "embodiment_id" in batch:
            out["embodiment_id"] = torch.as_tensor(batch["embodiment_id"]).long().reshape(b)
        elif self.sources is not None:  # a mix's policy at inference: the source's embodiment
            out["embodiment_id"] = torch.tensor([self.sources[i]["embodiment_id"] for i in index.tolist()],
                                                dtype=torch.long)
        else:
            out["embodiment_id"] = torch.full((b,), c.embodiment_id, dtype=torch.long)
        where = "groot_n1_6 processor"
        check_embodiment_ids(out["embodiment_id"], c.num_embodiments, where)
        # a clone per batch: the batches a DataLoader worker sends must not share storage
        out.update(pre.precompute(out["input_ids"], c, len(self.camera_keys), where=where,
                                  pos_weights=self.pos_weights.clone()))
        if train:
            if self.action_key not in batch:
                raise LoongError(f"groot_n1_6 processor: the batch has no '{self.action_key}' (needed for training)")
            action = torch.as_tensor(batch[self.action_key]).float()
            if action.dim() != 3 or action.shape[-1] != self.action_dim or action.shape[1] != c.chunk_size:
                raise LoongError(f"groot_n1_6 processor: '{self.action_key}' has shape {list(action.shape)}; expected "
                                 f"[b, chunk_size={c.chunk_size}, {self.action_dim}]")
            lo, hi = self.bounds(self.action_key, index)
            out["action"] = F.pad(min_max_normalize(action, lo.unsqueeze(1), hi.unsqueeze(1)),
                                  (0, c.max_action_dim - self.action_dim))
            pad_key = f"{self.action_key}_is_pad"
            valid_step = (~torch.as_tensor(batch[pad_key]).bool() if pad_key in batch
                          else torch.ones(action.shape[:2], dtype=torch.bool))
            mask = torch.zeros(b, c.chunk_size, c.max_action_dim)
            mask[:, :, : self.action_dim] = valid_step[..., None].float()
            out["action_mask"] = mask
        return out

    def postprocess(self, actions: torch.Tensor, source: int = 0) -> torch.Tensor:
        """Robot actions ``[..., action_dim]``: the real dims, unnormalised with source ``source``'s statistics
        (a mix's dataset index; 0 for one dataset)."""
        if not 0 <= source < len(self.source_stats):
            raise LoongError(f"groot_n1_6 processor: source {source} is not one of its {len(self.source_stats)} "
                             "datasets")
        at = self.source_stats[source][self.action_key]
        return min_max_unnormalize(actions[..., : self.action_dim].float().cpu(), at["min"], at["max"])

    # persistence ----------------------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """``groot_n1_6_processor.json`` (keys, features, min/max) and ``tokenizer/``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"camera_keys": self.camera_keys, "state_key": self.state_key, "action_key": self.action_key,
                "features": self.features,
                "stats": {k: {n: v.tolist() for n, v in s.items()} for k, s in self.stats.items()}}
        if self.sources is not None:  # a mix: sources 1.. after source 0's ``stats``, and which is which
            meta["source_stats"] = [{k: {n: v.tolist() for n, v in s.items()} for k, s in st.items()}
                                    for st in self.source_stats[1:]]
            write_sources(directory, self.sources)
        (directory / PROCESSOR_FILE).write_text(json.dumps(meta, indent=2, default=list), encoding="utf-8")
        self.tokenizer.save_pretrained(str(directory / TOKENIZER_DIR))

    @classmethod
    def load(cls, directory: Path, config: PolicyConfig) -> GrootN16Processor:
        """The processor :meth:`save` wrote into ``directory``."""
        assert isinstance(config, GrootN16Config)
        directory = Path(directory)
        meta_path = directory / PROCESSOR_FILE
        if not meta_path.is_file():
            raise LoongError(f"{directory}: no {PROCESSOR_FILE} (not a saved GR00T N1.6 processor)")
        meta = read_json(meta_path)
        tokenizer = load_tokenizer(str(directory / TOKENIZER_DIR))
        return cls(config, features=meta["features"], stats=meta["stats"], camera_keys=meta["camera_keys"],
                   state_key=meta["state_key"], action_key=meta["action_key"], tokenizer=tokenizer,
                   source=str(meta_path), source_stats=meta.get("source_stats", []), sources=read_sources(directory))


__all__ = ["GrootN16Processor", "eagle_prompt", "formalize", "load_tokenizer", "min_max_normalize",
           "min_max_unnormalize", "tiny_tokenizer"]
