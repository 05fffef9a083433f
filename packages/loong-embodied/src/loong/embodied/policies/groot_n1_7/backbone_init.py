"""GR00T N1.7's backbone from a Hugging Face Qwen3-VL folder (``model.config.base_model_path``).

The folder is what transformers' ``Qwen3VLForConditionalGeneration.save_pretrained`` writes (and what
``loong-vlm convert <run> <dst>`` writes for a Loong qwen3_vl checkpoint): ``config.json`` plus ``model.safetensors``
or a sharded ``model.safetensors.index.json``. Only safetensors are read (no pickle). The backbone's shape comes
from the folder's ``config.json`` (GR00T keeps its own ``select_layer``); the weights ``model.visual.*`` /
``model.language_model.*`` become ``backbone.visual.*`` / ``backbone.language_model.*``; ``lm_head`` and the decoder
layers at and above ``select_layer`` (GR00T truncates the LLM) are left out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loong.core.errors import LoongError

WHERE = "model.config.base_model_path"
#: the Qwen3VLConfig keyword arguments a backbone takes from the folder's config.json
BACKBONE_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                 "tie_word_embeddings", "text_config", "vision_config")
#: special tokens the GR00T processor writes: the folder's model must use the same ids
TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_LAYER = re.compile(r"^language_model\.layers\.(\d+)\.")


def read_backbone_config(path: str, processor_backbone: dict[str, Any]) -> dict[str, Any]:
    """The ``Qwen3VLConfig`` kwargs of the folder ``path``, checked against ``processor_backbone`` (the preset's
    backbone, whose token ids and vocabulary the processor writes)."""
    folder = Path(path).expanduser()
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise LoongError(f"{WHERE}={path}: no config.json there (a Hugging Face Qwen3-VL folder is expected, e.g. "
                         "what `loong-vlm convert <qwen3_vl run> <dst>` writes)")
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoongError(f"{WHERE}={path}: config.json is not readable JSON ({exc})") from None
    if not isinstance(hf, dict) or hf.get("model_type") != "qwen3_vl":
        got = hf.get("model_type") if isinstance(hf, dict) else None
        raise LoongError(f"{WHERE}={path}: config.json has model_type {got!r}; GR00T N1.7's backbone is a "
                         "'qwen3_vl' model")
    missing = [k for k in BACKBONE_KEYS if k not in hf and k != "tie_word_embeddings"]
    if missing:
        raise LoongError(f"{WHERE}={path}: config.json lacks {', '.join(missing)}")
    for key in TOKEN_KEYS:
        if key in processor_backbone and hf[key] != processor_backbone[key]:
            raise LoongError(f"{WHERE}={path}: config.json's {key} is {hf[key]}, the policy's processor writes "
                             f"{processor_backbone[key]} (the VLM must share the processor's special tokens)")
    vocab = hf["text_config"].get("vocab_size", 0)
    needed = processor_backbone.get("text_config", {}).get("vocab_size", 0)
    if vocab < needed:
        raise LoongError(f"{WHERE}={path}: config.json's text_config.vocab_size {vocab} is below the processor's "
                         f"vocabulary ({needed})")
    return {k: hf[k] for k in BACKBONE_KEYS if k in hf}


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise LoongError(f"{WHERE}={folder}: model.safetensors.index.json has no readable weight_map ({exc})") \
                from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise LoongError(f"{WHERE}={folder}: neither model.safetensors nor model.safetensors.index.json there "
                         "(only safetensors weights are read)")
    for file in files:
        if not file.is_file():
            raise LoongError(f"{WHERE}={folder}: the index names {file.name}, which is missing")
    return files


def _kept_name(key: str, select_layer: int) -> str | None:
    """The backbone's name for the folder's tensor ``key``, or None where GR00T leaves it out (``lm_head``: GR00T
    reads hidden states, not logits; decoder layers at and above ``select_layer``: GR00T truncates the LLM)."""
    if not key.startswith("model."):
        return None
    name = key.removeprefix("model.")
    layer = _LAYER.match(name)
    if layer is not None and int(layer.group(1)) >= select_layer:
        return None
    return name


def _kept_shapes(path: str, select_layer: int) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in _safetensors_files(Path(path).expanduser()):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = _kept_name(key, select_layer)
                if name is not None:
                    shapes[name] = tuple(f.get_slice(key).get_shape())
    return shapes


def backbone_weights(path: str, select_layer: int) -> dict[str, torch.Tensor]:
    """The folder's tensors a GR00T backbone truncated to ``select_layer`` decoder layers keeps, named as in the
    backbone (``visual.*``, ``language_model.*``: the ``model.`` prefix dropped)."""
    from safetensors.torch import load_file

    kept: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(Path(path).expanduser()):
        for key, value in load_file(str(file)).items():
            name = _kept_name(key, select_layer)
            if name is not None:
                kept[name] = value
    return kept


def check_backbone_fits(backbone_shapes: dict[str, tuple[int, ...]], path: str, select_layer: int) -> None:
    """Refuse a folder whose tensors (read from the safetensors headers only) do not fill ``backbone_shapes``
    (the backbone's state dict: name -> shape) exactly."""
    folder = _kept_shapes(path, select_layer)
    for name, shape in backbone_shapes.items():
        if name not in folder:
            raise LoongError(f"{WHERE}={path}: the folder has no tensor model.{name} (backbone.{name}, shape "
                             f"{list(shape)})")
        if folder[name] != tuple(shape):
            raise LoongError(f"{WHERE}={path}: tensor model.{name} has shape {list(folder[name])}, "
                             f"backbone.{name} needs {list(shape)}")
    extra = sorted(set(folder) - set(backbone_shapes))
    if extra:
        raise LoongError(f"{WHERE}={path}: tensors the backbone has no place for: "
                         f"{', '.join('model.' + k for k in extra[:5])}{' ...' if len(extra) > 5 else ''}")


def load_backbone(backbone: nn.Module, path: str, select_layer: int) -> None:
    """Copy the folder's weights into ``backbone`` (every tensor of its state dict, exact shapes; fp32 copies of
    fp32 weights are bit-exact)."""
    state = backbone.state_dict()
    check_backbone_fits({k: tuple(v.shape) for k, v in state.items()}, path, select_layer)
    weights = backbone_weights(path, select_layer)
    with torch.no_grad():
        for name, target in state.items():
            target.copy_(weights[name].to(target.dtype))


__all__ = ["backbone_weights", "check_backbone_fits", "load_backbone", "read_backbone_config"]
