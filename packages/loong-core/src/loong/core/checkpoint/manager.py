"""Atomic, sharded, layout-independent checkpoints.

Layout of ``<run>/checkpoints/``::

    step_00000100/        megatron-core dist_checkpointing shards (model + optimiser),
                          trainer_state.json, config.yaml, task artefacts (e.g. tokenizer)
    latest                the name of the newest complete step directory

A step is written into a hidden ``.step_XXXXXXXX.tmp`` directory and renamed when every rank has
finished; ``latest`` is replaced (write + ``os.replace``) last. A save killed half-way therefore
leaves only a stale temporary directory, and ``latest`` still names a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

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


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory from a step directory, a ``checkpoints`` folder or a run folder."""
    p = Path(path)
    for candidate in (p, p / "checkpoints"):
        if (candidate / LATEST).is_file():
            step_dir = candidate / (candidate / LATEST).read_text().strip()
            if not (step_dir / STATE_FILE).is_file():
                raise LoongError(f"{candidate / LATEST} names {step_dir.name}, which is missing or incomplete")
            return step_dir
    if (p / STATE_FILE).is_file():
        return p
    raise LoongError(f"{path} is not a Loong checkpoint (no {STATE_FILE} or '{LATEST}' file)")


def read_state(step_dir: Path) -> dict[str, Any]:
    """The trainer state saved with a checkpoint."""
    return json.loads((step_dir / STATE_FILE).read_text())


def read_config(step_dir: Path) -> dict[str, Any]:
    """The resolved run config saved with a checkpoint."""
    return yaml.safe_load((step_dir / CONFIG_FILE).read_text())


class CheckpointManager:
    """Saves and finds checkpoints of one run directory."""

    def __init__(self, root: Path, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        step_dir = self.root / pointer.read_text().strip()
        return step_dir if (step_dir / STATE_FILE).is_file() else None

    def save(self, step: int, engine: Any, state: dict[str, Any], config: dict[str, Any],
             artifacts: Any = None) -> Path:
        """Collective save of ``engine`` after ``step``; returns the final directory."""
        name = step_dir_name(step)
        final, tmp = self.root / name, self.root / f".{name}.tmp"
        if _is_rank0():
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        engine.save(tmp)
        _barrier()
        if _is_rank0():
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            (tmp / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
            if artifacts is not None:
                artifacts(tmp)
            old = self.root / f".{name}.old"
            if final.exists():  # re-saving a step: swap in, then drop the old copy
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            write_text_atomic(self.root / LATEST, name + "\n")
            self._prune(keep=name)
        _barrier()
        return final

    def _prune(self, keep: str) -> None:
        for stale in self.root.glob(".step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.keep_last <= 0:
            return
        steps = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in steps[: -self.keep_last]:
            if old.name != keep:
                shutil.rmtree(old, ignore_errors=True)
