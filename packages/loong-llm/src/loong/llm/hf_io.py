"""Read and write Hugging Face model folders (config.json + safetensors). Never unpickles anything."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

# the generic safetensors pieces live in the core (every modality's convert uses them); re-exported here
from loong.core.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    SafetensorsFolder,
    ShardWriter,
    parse_size,
    read_json,
)
from loong.core.errors import LoongError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
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
    config = read_json(folder / "config.json")
    if (folder / INDEX).is_file():
        weight_map: dict[str, str] = read_json(folder / INDEX).get("weight_map", {})
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


class HFTensors(SafetensorsFolder):
    """The tensors of a Hugging Face model folder (``model.safetensors`` or its indexed shards), read one at a
    time: :class:`loong.core.checkpoint.safetensors_io.SafetensorsFolder` with transformers' names."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path, stem="model", what="Hugging Face model folder", pickles="pytorch_model*.bin")


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
    writer = ShardWriter(path, max_shard_bytes)
    for key, tensor in state.items():
        writer.add(key, tensor)
    writer.close()
    return write_hf_metadata(path, hf_config, tokenizer_dir, generation_config)


def write_hf_metadata(path: str | Path, hf_config: dict[str, Any], tokenizer_dir: str | Path | None = None,
                      generation_config: dict[str, Any] | None = None) -> Path:
    """Write config.json, generation_config.json (from ``hf_config``'s token ids unless given) and, from
    ``tokenizer_dir``, the tokenizer files of an HF folder whose weights :class:`ShardWriter` writes."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
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


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "INDEX", "TOKENIZER_FILES", "WEIGHTS", "HFTensors", "ShardWriter", "copy_tokenizer",
           "parse_size", "read_hf_folder", "write_hf_folder", "write_hf_metadata"]
