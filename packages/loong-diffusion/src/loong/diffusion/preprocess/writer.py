"""The output folder of preprocessing: shards, their sidecars and the index, written so that any interruption
leaves a folder that the next run continues exactly.

Layout of ``OUT/``:

* ``shard-00000.safetensors``: the samples of one commit, tensors ``{j}.latents`` (``[c, f, h, w]``, float32) and
  ``{j}.text`` (``[tokens, text_dim]``, float32, trimmed to the caption's real length), ``j`` = 0, 1, ...;
  with ``--condition`` also ``{j}.condition`` (the image-to-video condition latent, shaped as the latents), with
  ``--image-encoder`` ``{j}.image`` (``[images · tokens, dim]`` CLIP features of the conditioning frames).
* ``shard-00000.json``: its sidecar, the **commit marker**: the manifest lines it covers, each sample's row,
  caption, bucket and shapes, the rows skipped in that range and why, and the SHA-256 of the manifest's bytes
  up to its last line. A shard without its sidecar does not exist for readers and is rewritten on resume.
* ``index.json``: the options and encoders the folder was made with, what the shards hold (``condition``:
  ``none`` | ``first`` | ``first_last``; ``image``: ``{images, tokens, dim}`` of the CLIP features, or null), the
  totals, and ``complete``.

Every file is written to a temporary name in ``OUT`` and renamed into place (atomic on POSIX), shard first, then
sidecar, then index: a kill at any point leaves committed shards intact and no partial file under a final name.
Sidecars are numbered densely from 0; resuming reads them in order, checks that the manifest still starts with
the lines they cover (by hash), and continues after the last one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loong.core.errors import LoongError
from loong.diffusion.data.shards import FORMAT, VERSION

INDEX = "index.json"
LOCK = ".preprocess.lock"


def shard_name(number: int) -> str:
    return f"shard-{number:05d}"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename (fsynced first, so a
    power loss cannot leave a renamed but empty file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, ensure_ascii=False) + "\n").encode())


def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """``safetensors.save_file`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        with tmp.open("rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def comparable(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without the folders' paths: moving the model folders does not change the output."""
    if isinstance(options, dict):
        return {k: comparable(v) for k, v in options.items() if k != "path"}
    return options


class ShardWriter:
    """Commits samples in shards into ``out`` (locked against a second concurrent writer)."""

    def __init__(self, out: Path, options: dict[str, Any]) -> None:
        self.out, self.options = out, options
        self._created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        self._lock = (out / LOCK).open("w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise LoongError(f"--output {out}: another preprocess is writing into this folder") from None
        for stale in out.glob(".*.tmp"):  # a killed run's unfinished temporary files
            stale.unlink()
        self.shards = 0
        self.lines_done = 0  # manifest lines covered by committed shards
        self.manifest_sha256: str | None = None
        self._totals: dict[str, Any] = {"clips": 0, "videos": 0, "images": 0, "skipped": 0, "buckets": {},
                                        "max_text_tokens": 0}
        self._skipped: list[dict[str, str]] = []
        while (path := out / f"{shard_name(self.shards)}.json").is_file():
            self._account(json.loads(path.read_text()))
        index = out / INDEX
        if index.is_file():
            previous = json.loads(index.read_text())
            if comparable(previous.get("options", {})) != comparable(options):
                raise LoongError(self._mismatch(previous.get("options", {})))
        elif self.shards:
            raise LoongError(f"--output {out}: holds shards but no {INDEX} (not a preprocess folder?); "
                             "use an empty folder")

    def _account(self, sidecar: dict[str, Any]) -> None:
        """Add one committed sidecar to the running totals (only totals are kept: a folder of millions of clips
        must not hold its whole sample list in memory)."""
        t = self._totals
        for sample in sidecar["samples"]:
            t["clips"] += 1
            t[f"{sample['kind']}s"] += 1
            t["buckets"][sample["bucket"]] = t["buckets"].get(sample["bucket"], 0) + 1
            t["max_text_tokens"] = max(t["max_text_tokens"], sample["text_tokens"])
        t["skipped"] += len(sidecar["skipped"])
        self._skipped.extend(sidecar["skipped"])
        self.shards += 1
        self.lines_done, self.manifest_sha256 = sidecar["lines"][1], sidecar["manifest_sha256"]

    def _mismatch(self, before: dict[str, Any]) -> str:
        a, b = comparable(before), comparable(self.options)
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        detail = "; ".join(f"{k}: was {a.get(k)!r}, now {b.get(k)!r}" for k in keys)
        return (f"--output {self.out}: was made with other options or encoders ({detail}); rerun with the "
                "same ones to continue it, or write to a new folder")

    # --- progress ----------------------------------------------------------------------------
    def totals(self) -> dict[str, Any]:
        """Clips (videos, images), skipped rows, clips per bucket and the longest caption's tokens so far."""
        return {**self._totals, "buckets": dict(sorted(self._totals["buckets"].items()))}

    def skipped(self) -> list[dict[str, str]]:
        """Every skipped row so far (``where``: file:line, ``reason``)."""
        return list(self._skipped)

    # --- commits -----------------------------------------------------------------------------
    def commit(self, samples: list[dict[str, Any]], tensors: dict[str, torch.Tensor], skipped: list[dict[str, str]],
               last_line: int, manifest_sha256: str, extra: dict[str, Any]) -> None:
        """Commit the samples (with their tensors) and skipped rows of manifest lines ``lines_done + 1 ..
        last_line``; then rewrite the index (``extra``: its fields beyond options and totals)."""
        name = shard_name(self.shards)
        file = None
        if samples:
            file = f"{name}.safetensors"
            atomic_save_tensors(self.out / file, tensors, {"format": FORMAT, "samples": str(len(samples))})
        sidecar = {"shard": file, "lines": [self.lines_done + 1, last_line], "manifest_sha256": manifest_sha256,
                   "samples": samples, "skipped": skipped}
        atomic_write_json(self.out / f"{name}.json", sidecar)
        self._account(sidecar)
        self.write_index(complete=False, extra=extra)

    def write_index(self, complete: bool, extra: dict[str, Any]) -> None:
        atomic_write_json(self.out / INDEX, {"format": FORMAT, "version": VERSION, "complete": complete,
                                             "options": self.options, **extra, "shards": self.shards,
                                             "lines": self.lines_done, **self.totals()})

    def close(self) -> None:
        """Release the folder; one this writer created and never committed to is removed again (a run that fails
        on its first row leaves nothing behind)."""
        self._lock.close()
        if self._created and not self.shards and not (self.out / INDEX).exists():
            (self.out / LOCK).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty: something else was put there meanwhile
                self.out.rmdir()


__all__ = ["FORMAT", "INDEX", "VERSION", "ShardWriter", "atomic_save_tensors", "atomic_write_json", "shard_name"]
