"""Read and write Hugging Face model folders (config.json + safetensors). Never unpickles anything."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loong.core.errors import LoongError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # transformers' default max_shard_size="5GB"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise LoongError(f"{path}: not valid JSON ({e})") from None


def _load(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise LoongError(f"{path}: weight file listed in {INDEX} is missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise LoongError(f"{path}: cannot read safetensors file ({e})") from None


def read_hf_folder(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json as a dict, every tensor) of a Hugging Face model folder, on CPU, dtypes as saved.

    Reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json``.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise LoongError(f"{folder}: no such Hugging Face model folder")
    if not (folder / "config.json").is_file():
        raise LoongError(f"{folder}: no config.json (not a Hugging Face model folder)")
    config = _read_json(folder / "config.json")
    if (folder / INDEX).is_file():
        weight_map: dict[str, str] = _read_json(folder / INDEX).get("weight_map", {})
        state: dict[str, torch.Tensor] = {}
        for shard in dict.fromkeys(weight_map.values()):
            state.update(_load(folder / shard))
        missing = sorted(set(weight_map) - set(state))
        if missing:
            raise LoongError(
                f"{folder}: {len(missing)} tensors in {INDEX} are not in its shards, e.g. {missing[:3]}"
            )
        return config, state
    if (folder / WEIGHTS).is_file():
        return config, _load(folder / WEIGHTS)
    if any(folder.glob("pytorch_model*.bin")):
        raise LoongError(
            f"{folder}: has only pytorch_model*.bin weights; loong reads safetensors only "
            "(re-save with transformers' save_pretrained(..., safe_serialization=True))"
        )
    raise LoongError(f"{folder}: no {WEIGHTS} or {INDEX}")


def _shards(state: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Keys in order, cut into groups of at most ``max_bytes`` (a bigger tensor gets a group alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


def _owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors safetensors accepts: contiguous, CPU, each with storage of its own (views are copied)."""
    seen: set[int] = set()
    out = {}
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        whole = t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
        if not whole or storage.data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def write_hf_folder(
    path: str | Path,
    hf_config: dict[str, Any],
    state: Mapping[str, torch.Tensor],
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Write a folder ``AutoModelForCausalLM.from_pretrained`` loads: config.json,
    generation_config.json, safetensors weights (sharded with an index above ``max_shard_bytes``)
    and, from ``tokenizer_dir``, the tokenizer files. Tensors are written in their own dtype.

    Earlier weight files in ``path`` are removed so no stale shard or index is left behind.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("model*.safetensors"), folder / INDEX]:
        old.unlink(missing_ok=True)
    groups = _shards(state, max_shard_bytes)
    n = len(groups)
    weight_map: dict[str, str] = {}
    for i, keys in enumerate(groups, start=1):
        name = WEIGHTS if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(_owned({k: state[k] for k in keys}), folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if generation_config is None:
        generation_config = {"_from_model_config": True}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if hf_config.get(key) is not None:
                generation_config[key] = hf_config[key]
    (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, folder)
    return folder


def copy_tokenizer(tokenizer_dir: str | Path, folder: str | Path) -> list[str]:
    """Copy the Hugging Face tokenizer files found in ``tokenizer_dir`` into ``folder``; their names."""
    src = Path(tokenizer_dir)
    found = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not found:
        raise LoongError(f"{src}: no tokenizer files (expected e.g. tokenizer.json or tokenizer.model)")
    for name in found:
        shutil.copyfile(src / name, Path(folder) / name)
    return found
