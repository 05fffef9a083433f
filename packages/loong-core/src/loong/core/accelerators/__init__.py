"""Accelerator plugins (entry-point group ``loong.accelerators``) and the selection rule.

The rule: a name passed in code wins, then ``$LOONG_ACCELERATOR``, then the highest-priority
accelerator whose ``is_available()`` is true. :func:`choose_accelerator` is that rule as a pure
function (it also says *why*), so ``loong env`` and the tests explain the same choice the run makes.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping

from loong.core.accelerators.base import Accelerator
from loong.core.errors import LoongError, did_you_mean

GROUP = "loong.accelerators"
ENV_VAR = "LOONG_ACCELERATOR"


def load_accelerators() -> tuple[dict[str, type[Accelerator]], dict[str, str]]:
    """Every installed accelerator class by entry-point name, and the entry points that failed to load.

    A broken third-party plugin is reported, not raised, so that ``loong env`` can still show it.
    """
    found: dict[str, type[Accelerator]] = {}
    failed: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        try:
            found[ep.name] = ep.load()
        except Exception as exc:  # any import-time failure of someone else's plugin
            failed[ep.name] = f"{ep.value}: {type(exc).__name__}: {exc}"
    return found, failed


def available_accelerators() -> dict[str, type[Accelerator]]:
    """Every installed accelerator class by name (available on this machine or not)."""
    found, failed = load_accelerators()
    if failed:
        name, why = next(iter(failed.items()))
        raise LoongError(f"accelerator plugin '{name}' failed to load ({why})")
    return found


def choose_accelerator(installed: Mapping[str, type[Accelerator]], name: str | None = None,
                       environ: Mapping[str, str] | None = None) -> tuple[type[Accelerator], str]:
    """The class the selection rule picks from ``installed``, and a short reason for ``loong env``."""
    environ = os.environ if environ is None else environ
    from_env = environ.get(ENV_VAR) or None
    requested = name or from_env
    if requested:
        why = f"requested in code ({requested!r})" if name else f"{ENV_VAR}={requested}"
        if requested not in installed:
            raise LoongError(
                f"unknown accelerator '{requested}'{did_you_mean(requested, installed)} "
                f"(installed: {', '.join(sorted(installed))})"
            )
        cls = installed[requested]
        reason = cls.unavailable_reason()
        if reason is not None:
            raise LoongError(
                f"accelerator '{requested}' is installed but not available on this machine: {reason}"
            )
        return cls, why
    usable = [cls for cls in installed.values() if cls.is_available()]
    if not usable:
        raise LoongError("no accelerator is available (is loong-core installed?)")
    best = max(usable, key=lambda c: c.priority)
    ranked = ", ".join(f"{c.name}={c.priority}" for c in sorted(usable, key=lambda c: -c.priority))
    return best, f"highest priority among the available ones ({ranked}); {ENV_VAR} is not set"


def select_accelerator(name: str | None = None) -> Accelerator:
    """``name``, else ``$LOONG_ACCELERATOR``, else the highest-priority available accelerator."""
    cls, _ = choose_accelerator(available_accelerators(), name)
    return cls()


__all__ = ["ENV_VAR", "GROUP", "Accelerator", "available_accelerators", "choose_accelerator",
           "load_accelerators", "select_accelerator"]
