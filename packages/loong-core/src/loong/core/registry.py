"""Typed registries filled by plugins (entry-point group ``loong.plugins``).

A package registers its entries with ``@MODELS.register("name")`` in a module that the entry point
names; the core imports installed plugins lazily on the first lookup, so installing a package is all
it takes to add its models, tasks and configs.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from loong.core.errors import LoongError, did_you_mean

PLUGIN_GROUP = "loong.plugins"
_loaded_plugins: set[str] = set()


def load_plugins() -> list[str]:
    """Import every installed ``loong.plugins`` entry point once; return their names."""
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        if ep.name not in _loaded_plugins:
            _loaded_plugins.add(ep.name)
            ep.load()
    return sorted(_loaded_plugins)


class _Lazy:
    """A registry entry not imported yet."""

    def __init__(self, target: str) -> None:
        self.target = target

    def load(self) -> object:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


class Registry[T]:
    """A name → object table with helpful errors for unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def add_lazy(self, name: str, target: str) -> None:
        """Register ``"package.module:attr"``, imported on first :meth:`get` (keeps plugins light:
        listing presets or ``--help`` must not import torch or megatron-core)."""
        self._entries.setdefault(name, _Lazy(target))  # type: ignore[arg-type]

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``; a second registration of a name fails."""

        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        """Register ``obj`` under ``name`` (re-registering the very same object is allowed)."""
        if isinstance(self._entries.get(name), _Lazy):
            self._entries[name] = obj  # the lazy target registering itself on import
        if name in self._entries and self._entries[name] is not obj:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        self._entries[name] = obj

    def get(self, name: str) -> T:
        """Look ``name`` up, loading plugins first; unknown names list the known ones."""
        if name not in self._entries:
            load_plugins()
        if name not in self._entries:
            known = ", ".join(sorted(self._entries)) or "(none installed)"
            raise LoongError(
                f"unknown {self.kind} '{name}'{did_you_mean(name, self._entries)} (known: {known})"
            )
        entry = self._entries[name]
        if isinstance(entry, _Lazy):
            entry = entry.load()
            self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        """All registered names, after loading plugins."""
        load_plugins()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        load_plugins()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


@dataclass(frozen=True)
class RunConfigSource:
    """What a CLI's ``train`` composes: Hydra's ``config_module`` / ``config_name`` and the run schema
    (``"package.module:Class"``, imported when needed). Registered in :data:`RUN_CONFIGS` under the CLI's name,
    so that the generated key reference (``python -m loong.core.config.docs``) covers every installed CLI."""

    config_module: str
    config_name: str
    schema: str


MODELS: Registry = Registry("model family")
TASKS: Registry = Registry("task")
ENGINES: Registry = Registry("engine")
CONFIG_DIRS: Registry = Registry("config source")
RUN_CONFIGS: Registry[RunConfigSource] = Registry("run config")

ENGINES.add_lazy("megatron", "loong.core.engines.megatron.engine:MegatronEngine")
ENGINES.add_lazy("fsdp", "loong.core.engines.fsdp.engine:FSDPEngine")
