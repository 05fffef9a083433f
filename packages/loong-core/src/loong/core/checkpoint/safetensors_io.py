"""Safetensors folders for every modality's ``convert``: sizes, sharded writing, lazy reading, bit-exact comparing.

The Hugging Face ecosystem writes one layout for transformers, diffusers and lerobot alike: ``<stem>.safetensors``,
or above a size limit ``<stem>-0000i-of-0000N.safetensors`` shards named by ``<stem>.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {tensor: shard}}``); ``stem`` is ``model`` (transformers,
lerobot) or ``diffusion_pytorch_model`` (diffusers). :class:`ShardWriter` writes it as tensors arrive,
:class:`SafetensorsFolder` reads it one tensor at a time, and :func:`compare_tensors` is ``--verify``'s check. It
lives in the core so that no modality imports another for it. Nothing here unpickles.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from loong.core.errors import LoongError

#: transformers' default ``max_shard_size="5GB"``
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


#: ``convert --dtype`` choices besides ``auto`` (the source's own dtype), the same in every modality's CLI
CONVERT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def convert_dtype(name: str, source: Iterable[torch.dtype], where: str) -> torch.dtype:
    """The dtype a ``convert`` writes for ``--dtype name``: that of ``name``, or for ``auto`` the source's (the most
    common floating dtype of its tensors ``source``; float32 when it has none). ``where`` names the source in the
    error for an ``auto`` dtype no model is built in (e.g. float64: pass ``--dtype``)."""
    if name in CONVERT_DTYPES:
        return CONVERT_DTYPES[name]
    if name != "auto":
        raise LoongError(f"--dtype {name}: one of auto, {', '.join(CONVERT_DTYPES)}")
    floats = [d for d in source if d.is_floating_point]
    dtype = max(set(floats), key=lambda d: (floats.count(d), str(d))) if floats else torch.float32
    if dtype not in CONVERT_DTYPES.values():
        raise LoongError(f"{where}: its weights are {str(dtype).removeprefix('torch.')}, which --dtype auto cannot "
                         f"keep; pass --dtype {' or '.join(CONVERT_DTYPES)}")
    return dtype


class VerifyError(LoongError):
    """``--verify`` found a tensor that differs between the two sides of a conversion (exit code 2)."""


def parse_size(text: str | int) -> int:
    """Bytes of a size written as transformers' ``max_shard_size``: ``5GB``, ``500MB``, ``2GiB``, ``1000``."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _SIZE_UNITS or float(m.group(1)) <= 0:
        raise LoongError(f"max shard size {text!r} is not a positive size like 5GB, 500MB, 2GiB or a byte count")
    return max(1, int(float(m.group(1)) * _SIZE_UNITS[unit]))


def weights_name(stem: str) -> str:
    """The single-file name of a folder's weights: ``model.safetensors``."""
    return f"{stem}.safetensors"


def index_name(stem: str) -> str:
    """The shard index's name: ``model.safetensors.index.json``."""
    return f"{stem}.safetensors.index.json"


def progress_bar(enabled: bool, what: str) -> Any:
    """A rich progress bar on stderr (as the ``preprocess`` commands draw); tasks carry a ``name`` field."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn(f"[bold]{what}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                    TextColumn("{task.fields[name]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=not enabled)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file of a model folder (config, index); one line naming the file when it is not valid JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoongError(f"{path}: not valid JSON ({e})") from None


def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
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
            raise LoongError(f"{path}: cannot read safetensors file (tensor {key} is truncated or of an unknown "
                             f"dtype {entry.get('dtype')})")
    return 8 + n, header


class SafetensorsFolder:
    """The tensors of a folder's ``<stem>.safetensors`` or indexed shards, read one at a time.

    Names, shapes and dtypes come from the safetensors headers; :meth:`get` reads one tensor's bytes with a
    plain file read into a tensor of its own. (Not ``safe_open``'s memory map: the mapped pages it touches stay
    resident and would make the whole folder count as the process's memory.) ``what`` names the folder's kind in
    errors; ``pickles`` are the pickled weight files whose presence earns a hint instead of "no weights".
    """

    def __init__(self, path: str | Path, stem: str = "model", what: str = "model folder",
                 pickles: str = "pytorch_model*.bin") -> None:
        folder = Path(path)
        weights, index = weights_name(stem), index_name(stem)
        if not folder.is_dir():
            raise LoongError(f"{folder}: no such {what}")
        if (folder / index).is_file():
            weight_map = read_json(folder / index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise LoongError(f"{folder / index}: no weight_map")
            files = list(dict.fromkeys(weight_map.values()))
        elif (folder / weights).is_file():
            weight_map, files = None, [weights]
        elif any(folder.glob(pickles)):
            raise LoongError(f"{folder}: has only {pickles} weights; loong reads safetensors only "
                             "(re-save with save_pretrained(..., safe_serialization=True))")
        else:
            raise LoongError(f"{folder}: no {weights} or {index}")
        self.folder = folder
        self.files = files
        self._where: dict[str, tuple[str, int, dict[str, Any]]] = {}
        for name in files:
            if not (folder / name).is_file():
                raise LoongError(f"{folder / name}: weight file listed in {index} is missing")
            base, header = safetensors_header(folder / name)
            for key, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                self._where.setdefault(key, (name, base, entry))
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self._where))
            if missing:
                raise LoongError(f"{folder}: {len(missing)} tensors in {index} are not in its shards, "
                                 f"e.g. {missing[:3]}")

    def keys(self) -> list[str]:
        """Every tensor name, in file order."""
        return list(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def file_of(self, key: str) -> str:
        """The shard file holding ``key``."""
        return self._where[key][0]

    def where(self, key: str) -> str:
        """``folder/shard`` of ``key``, for messages."""
        return str(self.folder / self.file_of(key))

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
        if end - start != math.prod(shape) * dtype.itemsize:
            raise LoongError(f"{self.folder / name}: tensor {key} has {end - start} bytes, its shape {list(shape)} "
                             f"and dtype {entry['dtype']} need {math.prod(shape) * dtype.itemsize}")
        return out.view(dtype).reshape(shape)

    def load_all(self) -> dict[str, torch.Tensor]:
        """Every tensor (whole folder in memory)."""
        return {k: self.get(k) for k in self._where}


class LazyTensors(Mapping[str, torch.Tensor]):
    """A read-only mapping over a :class:`SafetensorsFolder` whose ``[key]`` reads that one tensor when asked for
    (``cast``: applied to each tensor as it is read, e.g. a ``--dtype`` cast), so a mapping written for whole state
    dicts (``from_diffusers(state)``, which looks up the few parts it fuses) holds only what it builds, never the
    source model. ``meta()``: the same names as meta tensors, for checks of names, shapes and dtypes."""

    def __init__(self, folder: SafetensorsFolder,
                 cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        self.folder, self.cast = folder, cast

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.folder:
            raise KeyError(key)
        return self.cast(self.folder.get(key))

    def __iter__(self) -> Iterator[str]:
        return iter(self.folder.keys())

    def __len__(self) -> int:
        return len(self.folder.keys())

    def __contains__(self, key: object) -> bool:
        return key in self.folder

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor as a meta tensor of its saved shape and dtype (nothing read)."""
        return {k: torch.empty(self.folder.meta(k)[0], dtype=self.folder.meta(k)[1], device="meta")
                for k in self.folder.keys()}


class ShardWriter:
    """Write safetensors shards as tensors arrive: at most one shard (``max_shard_bytes``) is held in memory.

    Shards are written under temporary names and renamed ``<stem>-0000i-of-0000N.safetensors`` (or
    ``<stem>.safetensors`` when one suffices) by :meth:`close`, which also writes the index; a tensor larger
    than the limit gets a shard alone (as transformers does). Earlier weight files of ``stem`` are removed first
    so no stale shard or index is left behind.
    """

    def __init__(self, folder: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, stem: str = "model"
                 ) -> None:
        self.folder = Path(folder)
        self.stem = stem
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in [*self.folder.glob(f"{stem}*.safetensors"), self.folder / index_name(stem),
                    *self.folder.glob(".shard-*")]:
            old.unlink(missing_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_storages: set[int] = set()
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; a full shard is written first."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        # tied weights (an MTP layer's embedding and head) arrive one by one: each shard must own its storages
        self._pending.update(owned_tensors({key: tensor}, self._pending_storages))
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        tmp = self.folder / f".shard-{len(self._written) + 1:05d}.safetensors"
        save_file(self._pending, tmp, metadata={"format": "pt"})
        self._written.append((tmp, list(self._pending)))
        self._pending, self._pending_storages, self._pending_bytes = {}, set(), 0

    def close(self) -> list[str]:
        """Write the last shard, name the shards and write the index; the shard file names."""
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        weight_map: dict[str, str] = {}
        names = []
        for i, (tmp, keys) in enumerate(self._written, start=1):
            name = weights_name(self.stem) if n == 1 else f"{self.stem}-{i:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
            names.append(name)
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / index_name(self.stem)).write_text(json.dumps(index, indent=2) + "\n")
        return names


def write_shards(folder: str | Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int,
                 stem: str = "model", progress: Any = None) -> list[str]:
    """Write ``(name, tensor)`` pairs with a :class:`ShardWriter`; ``progress``: a ``(bar, task)`` to advance by
    each tensor's elements. The shard file names."""
    writer = ShardWriter(folder, max_shard_bytes, stem)
    for name, tensor in tensors:
        if progress is not None:
            progress[0].update(progress[1], name=name)
        writer.add(name, tensor)
        if progress is not None:
            progress[0].advance(progress[1], tensor.numel())
    return writer.close()



def write_safetensors(path: str | Path, entries: Mapping[str, tuple[Iterable[int], torch.dtype]],
                      get: Callable[[str], torch.Tensor], *, progress: Any = None,
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write the single safetensors file ``path`` without holding its tensors: the header is computed from
    ``entries`` (``{name: (shape, dtype)}``, the order the data is written in) before any tensor is asked for, then
    ``get(name)`` is called for one tensor at a time and its bytes written before the next is asked for, so memory
    stays at one tensor (where :class:`ShardWriter` holds a whole shard: a format read as one file, lerobot's
    ``model.safetensors``, would be held whole). ``progress``: a ``(bar, task)`` advanced by each tensor's
    elements. Written under a temporary name, renamed when complete; the bytes of tensor data."""
    path = Path(path)
    codes = {dtype: code for code, dtype in _ST_DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, (shape, dtype) in entries.items():
        if dtype not in codes:
            raise LoongError(f"{path}: tensor {name} is {dtype}, which safetensors cannot hold")
        shape = [int(s) for s in shape]
        end = offset + math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": codes[dtype], "shape": shape, "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for name, (_, dtype) in entries.items():
                if progress is not None:
                    progress[0].update(progress[1], name=name)
                tensor = get(name).detach().to("cpu")
                if list(tensor.shape) != header[name]["shape"] or tensor.dtype != dtype:
                    raise LoongError(f"{path}: tensor {name} came as {list(tensor.shape)} {tensor.dtype}, its "
                                     f"header says {header[name]['shape']} {dtype}")
                f.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
                if progress is not None:
                    progress[0].advance(progress[1], tensor.numel())
                del tensor
        os.replace(tmp, path)
    finally:  # a failed write leaves no partial file behind
        tmp.unlink(missing_ok=True)
    return offset

def owned_tensors(tensors: dict[str, torch.Tensor], seen: set[int] | None = None) -> dict[str, torch.Tensor]:
    """Tensors safetensors accepts: contiguous, CPU, each with storage of its own (views are copied). ``seen``: the
    storages already queued for the same file (tied weights added one by one), updated in place."""
    seen = set() if seen is None else seen
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


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where two same-shape, same-dtype tensors differ, for a person."""
    diff = (a.float() - b.float()).abs() if a.is_floating_point() else (a.double() - b.double()).abs()
    bad = (a.view(torch.uint8) != b.view(torch.uint8)).view(*a.shape, -1).any(-1) if a.dim() else diff > 0
    idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.any() else ()
    return (f"{int(bad.sum())} of {a.numel()} elements differ, first at {list(idx)} "
            f"({a[idx].item()!r} vs {b[idx].item()!r}), max |diff| {diff.max().item():.3g}")


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes (NaNs and -0.0 included)."""
    a, b = a.contiguous(), b.contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class TensorSource(Protocol):
    """What :func:`compare_tensors` reads a side from: a dict of tensors or a :class:`SafetensorsFolder`."""

    def keys(self) -> Iterable[str]: ...  # noqa: D102

    def get(self, key: str) -> Any: ...  # noqa: D102

    def __contains__(self, key: object) -> bool: ...  # noqa: D105


def compare_tensors(written: TensorSource, source: TensorSource, written_name: str, source_name: str, *,
                    ignore: Callable[[str], bool] = lambda key: False, progress: bool = False,
                    label: str = "verify") -> tuple[int, int, set[tuple[str, str]]]:
    """Compare two sides of a conversion, both under one naming (the family's mapping applied to one of them):
    the same names (``ignore``: names that may be on either side alone), the same shapes, and, after casting
    the source tensor to the written one's dtype (the ``--dtype`` rule), the same bits. ``(tensors, elements,
    {(written dtype, source dtype)})``; raises :class:`VerifyError` naming the first tensor that differs."""
    wanted = [k for k in written.keys() if not ignore(k)]
    extra = sorted(k for k in source.keys() if k not in written and not ignore(k))
    if extra:
        raise VerifyError(f"{label}: {source_name} has {len(extra)} tensors {written_name} lacks, e.g. {extra[:3]}")
    count = numel = 0
    dtypes: set[tuple[str, str]] = set()
    with progress_bar(progress, label) as bar:
        task = bar.add_task(label, total=len(wanted), name="")
        for key in wanted:
            bar.update(task, name=key)
            if key not in source:
                raise VerifyError(f"{label}: {key} is in {written_name} but not in {source_name}")
            ours, theirs = written.get(key), source.get(key)
            if tuple(ours.shape) != tuple(theirs.shape):
                raise VerifyError(f"{label}: {key} has shape {tuple(ours.shape)} in {written_name}, "
                                  f"{tuple(theirs.shape)} in {source_name}")
            dtypes.add((str(ours.dtype).removeprefix("torch."), str(theirs.dtype).removeprefix("torch.")))
            cast = theirs.to(ours.dtype)
            if not bit_equal(ours, cast):
                raise VerifyError(f"{label}: {key} differs between {written_name} and {source_name}: "
                                  f"{first_difference(ours.contiguous(), cast.contiguous())}")
            count += 1
            numel += ours.numel()
            bar.advance(task, 1)
    return count, numel, dtypes


def verify_summary(parts: Iterable[tuple[int, int, set[tuple[str, str]]]], written: str, source: str,
                   start: float) -> str:
    """The one line ``--verify`` prints for the :func:`compare_tensors` results ``parts`` (``start``: a
    ``time.perf_counter()`` taken before reading)."""
    count = numel = 0
    dtypes: set[tuple[str, str]] = set()
    for c, n, d in parts:
        count, numel, dtypes = count + c, numel + n, dtypes | d
    kinds = ", ".join(f"{written} {w} / {source} {s}" for w, s in sorted(dtypes))
    return (f"verify: {count} tensors, {numel:,} parameters match bit for bit ({kinds}) "
            f"in {time.perf_counter() - start:.1f} s")


__all__ = ["CONVERT_DTYPES", "DEFAULT_MAX_SHARD_BYTES", "LazyTensors", "SafetensorsFolder", "ShardWriter", "TensorSource",
           "VerifyError", "bit_equal", "compare_tensors", "convert_dtype", "first_difference", "index_name",
           "owned_tensors", "parse_size", "progress_bar", "read_json", "safetensors_header", "verify_summary", "weights_name",
           "write_safetensors", "write_shards"]
