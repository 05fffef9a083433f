"""Atomic, verified, sharded, layout-independent checkpoints.

Layout of ``<run>/checkpoints/``::

    step_00000100/        the engine's shards (model + optimiser: megatron-core dist_checkpointing or torch DCP),
                          rng/rank_XXXXX.pt, trainer_state.json, config.yaml, task artefacts,
                          manifest.json (sizes + SHA-256 of every other file, written last)
    latest                the name of the newest complete step directory (for people and tools)

A step is written into a hidden ``.step_XXXXXXXX.tmp`` directory; the manifest is written last, then
the directory is renamed and ``latest`` replaced. A save killed at any point therefore leaves a stale
temporary directory (removed by the next save) and the previous checkpoints untouched; a step
directory without a valid manifest is never loaded. ``resume=auto`` takes the newest step directory
that verifies and says why it skipped any newer one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from loong.core.checkpoint.manifest import (
    MANIFEST,
    build_manifest,
    checkpoint_problem,
    saved_at,
    write_manifest,
)
from loong.core.errors import LoongError

LATEST = "latest"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimiser steps."""
    return f"step_{step:08d}"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def step_dirs(root: Path) -> list[Path]:
    """Step directories under ``root``, most recently completed first; broken ones (no readable
    manifest) before all of them.

    Completion time, not the step number, decides: a run resumed from an earlier step into the same
    directory continues from what it saved last, not from the abandoned later steps.
    """
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: (saved_at(p), p.name),
                  reverse=True)


def verify_checkpoint(step_dir: Path, checksums: bool = True) -> None:
    """Raise LoongError naming what is wrong when ``step_dir`` is not a complete, intact checkpoint."""
    problem = checkpoint_problem(step_dir, checksums)
    if problem is None:
        return
    older = [p for p in step_dirs(step_dir.parent) if p.name < step_dir.name]
    good = next((p for p in older if checkpoint_problem(p, checksums=False) is None), None)
    hint = f"; the checkpoint before it is {good}" if good else ""
    raise LoongError(f"checkpoint {step_dir} cannot be loaded: {problem}{hint}")


def resolve_checkpoint(path: str | Path, verify: bool = True) -> Path:
    """A step directory from a step directory, a ``checkpoints`` folder or a run folder.

    A folder resolves to its newest step directory that verifies; a step directory named directly
    must verify itself (``verify=False`` skips the checksums, not the manifest).
    """
    p = Path(path)
    if (p / STATE_FILE).is_file() or (p / MANIFEST).is_file():
        verify_checkpoint(p, checksums=verify)
        return p
    for candidate in (p, p / "checkpoints"):
        if step_dirs(candidate):
            found, skipped = newest_good(candidate, checksums=verify)
            if found is None:
                reasons = "; ".join(f"{d.name}: {why}" for d, why in skipped)
                raise LoongError(f"{candidate} holds no complete checkpoint ({reasons})")
            return found
    raise LoongError(f"{path} is not a Loong checkpoint (no {STATE_FILE}, {MANIFEST} or step_* directories)")


def newest_good(root: Path, checksums: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest verified step directory under ``root`` and the newer ones skipped, with why."""
    skipped = []
    for step_dir in step_dirs(root):
        problem = checkpoint_problem(step_dir, checksums)
        if problem is None:
            return step_dir, skipped
        skipped.append((step_dir, problem))
    return None, skipped


def read_state(step_dir: Path) -> dict[str, Any]:
    """The trainer state saved with a checkpoint."""
    return json.loads((step_dir / STATE_FILE).read_text())


def read_config(step_dir: Path) -> dict[str, Any]:
    """The resolved run config saved with a checkpoint."""
    return yaml.safe_load((step_dir / CONFIG_FILE).read_text())


class CheckpointManager:
    """Saves and finds the checkpoints of one run directory.

    Args:
        root: the ``checkpoints`` folder.
        keep_last: keep this many newest complete checkpoints (0: keep all); incomplete or corrupted
            directories never count, and the checkpoint just written is never deleted.
        checksums: write and verify SHA-256 checksums (sizes are always checked).
    """

    def __init__(self, root: Path, keep_last: int = 2, checksums: bool = True) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.checksums = checksums
        self._pending: Any = None  # the engine's PendingSave while an async save is in flight

    def latest(self) -> Path | None:
        """The newest complete, verified checkpoint, or None (collective with checksums)."""
        return newest_good(self.root, self.checksums)[0]

    def save(self, step: int, engine: Any, state: dict[str, Any], config: dict[str, Any],
             artifacts: Callable[[Path], None] | None = None,
             every_rank: Callable[[Path], None] | None = None, async_save: bool = False) -> Path:
        """Collective save of ``engine`` after ``step``; returns the final directory.

        ``every_rank(dir)`` writes per-rank files (RNG states); ``artifacts(dir)`` task files on rank
        0. With ``async_save`` the engine's shards are written in the background; the manifest,
        rename and ``latest`` follow when they are done (:meth:`poll` / :meth:`wait`).
        """
        self.wait()  # one save in flight at a time
        name = step_dir_name(step)
        final, tmp = self.root / name, self.root / f".{name}.tmp"
        if _is_rank0():
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()

        def finish() -> None:
            self._finish(name, tmp, final, state, config, artifacts)

        if async_save:
            self._pending = engine.save_async(tmp, finish)
            if every_rank is not None:  # after the engine's save starts: it may expect an empty directory
                every_rank(tmp)
            return final
        engine.save(tmp)
        if every_rank is not None:
            every_rank(tmp)
        finish()
        return final

    def poll(self) -> None:
        """Complete an async save whose shards are written (collective; cheap when none is pending)."""
        if self._pending is not None and self._pending.finish(blocking=False):
            self._pending = None

    def wait(self) -> None:
        """Block until an async save in flight is complete (collective)."""
        if self._pending is not None:
            self._pending.finish(blocking=True)
            self._pending = None

    def _finish(self, name: str, tmp: Path, final: Path, state: dict[str, Any], config: dict[str, Any],
                artifacts: Callable[[Path], None] | None) -> None:
        _barrier()
        if _is_rank0():
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            (tmp / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
            if artifacts is not None:
                artifacts(tmp)
        _barrier()
        manifest = build_manifest(tmp, self.checksums)  # collective: ranks hash shares of the files
        if _is_rank0():
            write_manifest(tmp, manifest)
            old = self.root / f".{name}.old"
            if final.exists():  # re-saving a step: swap in, then drop the old copy
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            write_text_atomic(self.root / LATEST, name + "\n")
            self._prune(keep=name)
        _barrier()

    def _prune(self, keep: str) -> None:
        for stale in self.root.glob(".step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.keep_last <= 0:
            return
        # Only complete checkpoints count towards keep_last; sizes suffice here (the new one was
        # just hashed, older ones were verified when written), and broken ones are left for a person.
        complete = [p for p in step_dirs(self.root) if checkpoint_problem(p, checksums=False) is None]
        for old in complete[self.keep_last :]:
            if old.name != keep:
                shutil.rmtree(old, ignore_errors=True)
