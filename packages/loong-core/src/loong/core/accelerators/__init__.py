"""Accelerator plugins (entry-point group ``loong.accelerators``) and the selection rule."""

from __future__ import annotations

import importlib.metadata
import os

from loong.core.accelerators.base import Accelerator
from loong.core.errors import LoongError, did_you_mean

GROUP = "loong.accelerators"


def available_accelerators() -> dict[str, type[Accelerator]]:
    """Every installed accelerator class by name (available on this machine or not)."""
    found: dict[str, type[Accelerator]] = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        found[ep.name] = ep.load()
    return found


def select_accelerator(name: str | None = None) -> Accelerator:
    """``name``, else ``$LOONG_ACCELERATOR``, else the highest-priority available accelerator."""
    name = name or os.environ.get("LOONG_ACCELERATOR") or None
    installed = available_accelerators()
    if name:
        if name not in installed:
            raise LoongError(
                f"unknown accelerator '{name}'{did_you_mean(name, installed)} "
                f"(installed: {', '.join(sorted(installed))})"
            )
        cls = installed[name]
        if not cls.is_available():
            raise LoongError(f"accelerator '{name}' is installed but not available on this machine")
        return cls()
    usable = [cls for cls in installed.values() if cls.is_available()]
    if not usable:
        raise LoongError("no accelerator is available (is loong-core installed?)")
    return max(usable, key=lambda c: c.priority)()


__all__ = ["Accelerator", "available_accelerators", "select_accelerator"]
