"""Checkpoint integrity: a manifest of every file's size and SHA-256, written last, checked before loading.

A step directory counts as a checkpoint only when its ``manifest.json`` exists and every file it
lists has the recorded size (and, when checked, checksum). Hashing is spread over the ranks of a
process group (each hashes a share of the files), so a large sharded checkpoint is hashed in
parallel rather than by rank 0 alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

MANIFEST = "manifest.json"
FORMAT = 1


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def _share(items: list[str]) -> list[str]:
    """This rank's share of ``items`` (all of them outside a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return items
    return items[dist.get_rank() :: dist.get_world_size()]


def _merge(part: dict[str, Any]) -> dict[str, Any]:
    """Union of every rank's ``part`` (collective inside a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return part
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    merged: dict[str, Any] = {}
    for p in parts:
        merged.update(p)
    return merged


def build_manifest(directory: Path, checksums: bool = True) -> dict[str, Any]:
    """Sizes (and SHA-256) of every file under ``directory``; collective inside a process group."""
    def describe(name: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"size": (directory / name).stat().st_size}
        if checksums:
            meta["sha256"] = _sha256(directory / name)
        return meta

    # Nothing touches the directory after the exchange: rank 0 renames it right after.
    files = _merge({n: describe(n) for n in _share(_files(directory))})
    files = dict(sorted(files.items()))
    return {"format": FORMAT, "saved_at": time.time(), "checksum": "sha256" if checksums else None,
            "files": files}


def saved_at(directory: Path) -> float:
    """When the checkpoint in ``directory`` was completed (+inf without a readable manifest, so that
    broken directories are examined, and reported, before any complete one)."""
    try:
        return float(json.loads((directory / MANIFEST).read_text())["saved_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return math.inf


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest (the last file of a save; call on one rank)."""
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(directory / MANIFEST)


def checkpoint_problem(directory: Path, checksums: bool = True) -> str | None:
    """Why ``directory`` is not a complete, intact checkpoint, or None when it is.

    Collective inside a process group when ``checksums`` (every rank must call it).
    """
    path = directory / MANIFEST
    if not path.is_file():
        return f"incomplete: no {MANIFEST} (the save did not finish)"
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    version = manifest.get("format", FORMAT)
    if not isinstance(version, int) or version > FORMAT:  # its layout may differ in ways this code cannot read
        return (f"written by a newer Loong (checkpoint format {version}; this Loong reads format {FORMAT}); "
                "upgrade Loong to load it")
    problem = None
    for name, meta in files.items():
        f = directory / name
        if not f.is_file():
            problem = problem or f"{name} is missing"
        elif f.stat().st_size != meta["size"]:
            problem = problem or f"{name} is {f.stat().st_size} bytes, the manifest says {meta['size']} (truncated?)"
    # Every rank takes part in the checksum exchange, even when sizes already failed on this one.
    bad: dict[str, str] = {}
    if checksums and manifest.get("checksum") == "sha256":
        for name in _share(sorted(files)):
            f = directory / name
            if f.is_file() and f.stat().st_size == files[name]["size"] and _sha256(f) != files[name]["sha256"]:
                bad[name] = "checksum mismatch"
        bad = _merge(bad)
    if problem:
        return problem
    if bad:
        name = sorted(bad)[0]
        return f"{name} is corrupted (SHA-256 differs from the manifest)"
    return None
