"""Compose a run config with Hydra from the packaged config groups of every installed plugin.

Overrides are checked against the schema *before* Hydra sees them, so a typo fails with its dotted
path and the closest valid key rather than with Hydra's generic composition error.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loong.core.config.checks import check_paths
from loong.core.config.schema import from_dict, schema_keys, to_dict
from loong.core.errors import LoongError, did_you_mean
from loong.core.registry import CONFIG_DIRS

DEFAULTS_NODE = "_loong_defaults_"


def _search_path() -> list[str]:
    return [CONFIG_DIRS.get(name) for name in CONFIG_DIRS.names()]


def _with_hydra(config_module: str, fn: typing.Callable[[], Any], schema: type | None = None) -> Any:
    from hydra.core.config_store import ConfigStore

    if schema is not None:
        # The schema's defaults are the base of every primary config (``- _loong_defaults_``),
        # so YAML files only state what differs and every schema key is overridable.
        ConfigStore.instance().store(name=DEFAULTS_NODE, node=to_dict(schema()))
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=config_module, version_base=None):
            return fn()
    finally:
        GlobalHydra.instance().clear()


def config_groups(config_module: str) -> dict[str, list[str]]:
    """Config groups (e.g. ``model``) and their options, across every installed plugin."""

    def read() -> dict[str, list[str]]:
        loader = GlobalHydra.instance().config_loader()
        extra = _search_path()
        for path in extra:
            loader.get_search_path().append(provider="loong-plugin", path=path)
        groups = {}
        for group in loader.list_groups(""):
            if group == "hydra":
                continue
            groups[group] = sorted(loader.get_group_options(group))
        return groups

    return _with_hydra(config_module, read)  # groups do not depend on the schema


def _dataclass_at(schema: type, dotted: str) -> type | None:
    """The dataclass type a dotted key prefix points to (None when it is not a dataclass)."""
    tp: Any = schema
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return None
        tp = hints[part]
    return tp if dataclasses.is_dataclass(tp) else None


def _check_overrides(overrides: list[str], schema: type, groups: dict[str, list[str]]) -> None:
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        raise LoongError(f"cannot parse override: {str(exc).splitlines()[0]}") from None
    keys = schema_keys(schema)
    for o in parsed:
        key = o.key_or_group
        if key in groups and not o.is_delete():
            value = o.value()
            if isinstance(value, str) and value not in groups[key]:
                raise LoongError(
                    f"unknown {key} preset '{value}'{did_you_mean(value, groups[key])} "
                    f"(available: {', '.join(groups[key])})"
                )
            continue
        if key in keys:
            continue
        # Keys under a free-form (non-dataclass) subtree are checked after composition.
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        if parent and parent in keys and _dataclass_at(schema, parent) is None:
            continue
        raise LoongError(f"unknown config key '{key}'{did_you_mean(key, keys)}")


def compose_config(
    config_module: str, config_name: str, overrides: list[str], schema: type
) -> tuple[Any, dict]:
    """Compose ``config_name`` from ``config_module`` plus ``overrides`` and validate it.

    Returns the typed config (an instance of ``schema``) and the resolved plain dict. Every value is checked
    (:func:`~loong.core.config.schema.from_dict`), paths that must exist included (:func:`check_paths`).
    """
    overrides = list(overrides)
    groups = config_groups(config_module)
    _check_overrides(overrides, schema, groups)
    extra = _search_path()
    if extra:
        overrides.append("hydra.searchpath=[" + ",".join(extra) + "]")

    def run() -> dict:
        cfg = compose(config_name=config_name, overrides=overrides)
        return OmegaConf.to_container(cfg, resolve=True)

    try:
        plain = _with_hydra(config_module, run, schema)
    except (HydraException, OmegaConfBaseException) as exc:
        raise LoongError(f"config: {str(exc).splitlines()[0]}") from None
    plain.pop("hydra", None)
    cfg = from_dict(schema, plain)
    check_paths(cfg)
    return cfg, plain
