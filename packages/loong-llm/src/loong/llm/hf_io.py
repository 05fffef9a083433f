"""Read and write Hugging Face model folders (config.json + safetensors). Never unpickles anything."""

from __future__ import annotations

import json
import os
import re
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


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of a size written as transformers' ``max_shard_size``: ``5GB``, ``500MB``, ``2GiB``, ``1000``."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _SIZE_UNITS or float(m.group(1)) <= 0:
        raise LoongError(f"max shard size {text!r} is not a positive size like 5GB, 500MB, 2GiB or a byte count")
    return max(1, int(float(m.group(1)) * _SIZE_UNITS[unit]))


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


def _safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data, header entries) of a safetensors file, with a one-line error when it is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            size = path.stat().st_size
            if n <= 0 or 8 + n > size:
                raise ValueError("truncated or not a safetensors file")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise LoongError(f"{path}: cannot read safetensors file ({e})") from None
    header.pop("__metadata__", None)
    for key, entry in header.items():
        start, end = entry["data_offsets"]
        if entry.get("dtype") not in _ST_DTYPES or 8 + n + end > size:
            raise LoongError(f"{path}: tensor {key} is truncated or of an unknown dtype {entry.get('dtype')}")
    return 8 + n, header


class HFTensors:
    """The tensors of a Hugging Face model folder, read one at a time.

    Names, shapes and dtypes come from the safetensors headers; :meth:`get` reads one tensor's bytes with a
    plain file read into a tensor of its own. (Not ``safe_open``'s memory map: the mapped pages it touches stay
    resident and would make the whole folder count as the process's memory.)
    """

    def __init__(self, path: str | Path) -> None:
        folder = Path(path)
        if not folder.is_dir():
            raise LoongError(f"{folder}: no such Hugging Face model folder")
        if (folder / INDEX).is_file():
            weight_map = _read_json(folder / INDEX).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise LoongError(f"{folder / INDEX}: no weight_map")
            files = list(dict.fromkeys(weight_map.values()))
        elif (folder / WEIGHTS).is_file():
            weight_map, files = None, [WEIGHTS]
        elif any(folder.glob("pytorch_model*.bin")):
            raise LoongError(f"{folder}: has only pytorch_model*.bin weights; loong reads safetensors only "
                             "(re-save with transformers' save_pretrained(..., safe_serialization=True))")
        else:
            raise LoongError(f"{folder}: no {WEIGHTS} or {INDEX}")
        self.folder = folder
        self._where: dict[str, tuple[str, int, dict[str, Any]]] = {}
        for name in files:
            if not (folder / name).is_file():
                raise LoongError(f"{folder / name}: weight file listed in {INDEX} is missing")
            base, header = _safetensors_header(folder / name)
            for key, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                self._where.setdefault(key, (name, base, entry))
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self._where))
            if missing:
                raise LoongError(f"{folder}: {len(missing)} tensors in {INDEX} are not in its shards, "
                                 f"e.g. {missing[:3]}")

    def keys(self) -> list[str]:
        """Every tensor name, in file order."""
        return list(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def file_of(self, key: str) -> str:
        """The shard file holding ``key``."""
        return self._where[key][0]

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of ``key`` without reading it."""
        entry = self._where[key][2]
        return tuple(entry["shape"]), _ST_DTYPES[entry["dtype"]]

    def get(self, key: str) -> torch.Tensor:
        """Read one tensor (a copy of its own, on CPU, dtype as saved)."""
        if key not in self._where:
            raise LoongError(f"{self.folder}: no tensor {key}")
        name, base, entry = self._where[key]
        start, end = entry["data_offsets"]
        shape, dtype = self.meta(key)
        out = torch.empty(end - start, dtype=torch.uint8)
        with open(self.folder / name, "rb") as f:
            f.seek(base + start)
            if f.readinto(memoryview(out.numpy())) != end - start:
                raise LoongError(f"{self.folder / name}: tensor {key} is truncated")
        if end - start != _numel(shape) * dtype.itemsize:
            raise LoongError(f"{self.folder / name}: tensor {key} has {end - start} bytes, its shape {list(shape)} "
                             f"and dtype {entry['dtype']} need {_numel(shape) * dtype.itemsize}")
        return out.view(dtype).reshape(shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class ShardWriter:
    """Write safetensors shards as tensors arrive: at most one shard (``max_shard_bytes``) is held in memory.

    Shards are written under temporary names and renamed ``model-0000i-of-0000N.safetensors`` (or
    ``model.safetensors`` when one suffices) by :meth:`close`, which also writes the index; a tensor larger
    than the limit gets a shard alone (as transformers does).
    """

    def __init__(self, folder: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in [*self.folder.glob("model*.safetensors"), self.folder / INDEX, *self.folder.glob(".shard-*")]:
            old.unlink(missing_ok=True)  # no stale shard or index from an earlier write is left behind
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; a full shard is written first."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending.update(_owned({key: tensor}))
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        tmp = self.folder / f".shard-{len(self._written) + 1:05d}.safetensors"
        save_file(self._pending, tmp, metadata={"format": "pt"})
        self._written.append((tmp, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, name the shards and write the index; the shard file names."""
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        weight_map: dict[str, str] = {}
        names = []
        for i, (tmp, keys) in enumerate(self._written, start=1):
            name = WEIGHTS if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
            names.append(name)
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names


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
