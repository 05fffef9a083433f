"""Where a run lives: the rule that makes rerunning the same command continue the run.

- ``run_name=NAME``: ``<output_dir>/NAME``, as given.
- ``train.resume=none`` (without ``run_name``): a new ``<output_dir>/<preset>-<YYYYmmdd-HHMMSS>`` each time.
- otherwise ``<output_dir>/<preset>-<id>``, ``id`` the first 10 hex digits of the SHA-256 of the run's
  *identity*: the resolved config without the keys marked ``KEEPS_RUN`` in the schema (``train.steps``, the
  log / eval / save cadences, ``output_dir``, ``train.resume``, what to do on a failure, exports; see
  :mod:`loong.core.config.checks`) and without the values equal to the schema's defaults, so that a key added
  to the schema later, with its default, does not move every existing run to a new directory.

The identical command therefore finds the same directory and continues its newest good checkpoint
(``train.resume=auto``), also after a SIGKILL, a crash or an elastic restart, and on another number of
processes (the world size is not part of the config). Raising ``train.steps`` continues a finished run.
A change to any other key is another run: a new directory, and the walk names the keys in which it differs
from the newest earlier run of the same preset (:func:`new_run_note`) and how to continue that one instead.

Why a deterministic directory rather than "the newest run whose saved config equals this one": it needs
no search and no agreement between ranks or restarts, a run killed before its first checkpoint is found
again, and two different runs started at once under one ``output_dir`` never pick each other's directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from loong.core.checkpoint import LATEST, read_config
from loong.core.config.checks import keeps_run_keys
from loong.core.config.schema import to_dict

ID_DIGITS = 10
_MISSING = object()


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` → ``{"train.lr": 1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def identity(plain: dict[str, Any], schema: type) -> dict[str, Any]:
    """The keys of a resolved config (``plain``, as saved in checkpoints) that define the run: every key not
    marked ``KEEPS_RUN`` in ``schema`` whose value differs from the schema's default."""
    defaults = flatten(to_dict(schema()))
    keep = keeps_run_keys(schema)

    def kept(key: str) -> bool:
        parts = key.split(".")
        return any(".".join(parts[:i]) in keep for i in range(1, len(parts) + 1))

    return {k: v for k, v in sorted(flatten(plain).items()) if not kept(k) and defaults.get(k, _MISSING) != v}


def run_id(plain: dict[str, Any], schema: type) -> str:
    """The ``id`` of the default run directory ``<preset>-<id>`` (see the module docstring)."""
    text = json.dumps(identity(plain, schema), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:ID_DIGITS]


def _preset(cfg: Any) -> str:
    return str(getattr(cfg.model, "preset", None) or "run").replace(os.sep, "_")


def fresh_start(cfg: Any) -> bool:
    """``train.resume=none``: start from step 0 whatever the run directory holds."""
    return cfg.train.resume in ("none", "never", "")


def run_directory(cfg: Any, plain: dict[str, Any]) -> Path:
    """The run directory of ``cfg`` (``plain``: its resolved dict) by the rule in the module docstring. The same on
    every rank (the timestamp of a ``train.resume=none`` run is rank 0's, or the launcher's ``LOONG_RUN_STAMP``)."""
    if cfg.run_name is not None:
        return Path(cfg.output_dir) / cfg.run_name
    if not fresh_start(cfg):
        return Path(cfg.output_dir) / f"{_preset(cfg)}-{run_id(plain, type(cfg))}"
    # a launcher that may restart the run (--max-restarts) fixes the stamp for every attempt
    stamp = [f"{_preset(cfg)}-{os.environ.get('LOONG_RUN_STAMP') or time.strftime('%Y%m%d-%H%M%S')}"]
    if dist.is_initialized():
        dist.broadcast_object_list(stamp, src=0)  # one name for every rank
    return Path(cfg.output_dir) / stamp[0]


def _saved_config(run: Path) -> dict[str, Any] | None:
    """The config of a run directory's latest checkpoint, or None (no checkpoint, unreadable)."""
    try:
        name = (run / "checkpoints" / LATEST).read_text().strip()
        return read_config(run / "checkpoints" / name)
    except (OSError, ValueError):
        return None


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def differences(old: dict[str, Any], new: dict[str, Any], schema: type, limit: int = 6) -> list[str]:
    """``key (old -> new)`` for the keys in which the identities of two resolved configs differ (at most
    ``limit``, then a count)."""
    a, b = identity(old, schema), identity(new, schema)
    keys = sorted(k for k in set(a) | set(b) if a.get(k, _MISSING) != b.get(k, _MISSING))
    flat_old, flat_new = flatten(old), flatten(new)
    out = [f"{k} ({_short(flat_old.get(k, 'unset'))} -> {_short(flat_new.get(k, 'unset'))})" for k in keys[:limit]]
    return out + ([f"{len(keys) - limit} more"] if len(keys) > limit else [])


def new_run_note(cfg: Any, plain: dict[str, Any], run_dir: Path) -> str | None:
    """For a new default-named run: which keys differ from the newest earlier run of the same preset under
    ``output_dir`` (by its latest checkpoint), and how to continue that one instead; None when there is none."""
    if cfg.run_name is not None or fresh_start(cfg) or not Path(cfg.output_dir).is_dir():
        return None
    schema = type(cfg)
    runs = [p for p in Path(cfg.output_dir).glob(f"{_preset(cfg)}-*")
            if p != run_dir and (p / "checkpoints" / LATEST).is_file()]
    for run in sorted(runs, key=lambda p: (p / "checkpoints" / LATEST).stat().st_mtime, reverse=True):
        saved = _saved_config(run)
        if saved is None:
            continue
        diff = differences(saved, plain, schema)
        if not diff:  # same identity under another name (renamed, or made before this rule): nothing to say
            return None
        return (f"new run {run_dir.name}: the config differs from the newest earlier run {run.name} in "
                f"{', '.join(diff)}; to continue that run with this config instead, pass run_name={run.name}")
    return None
