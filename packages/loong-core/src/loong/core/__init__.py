"""Loong core: registry, config, accelerators, parallel layouts, engines, trainer, checkpoints, CLI kit."""

from importlib.metadata import version as _package_version

__version__ = _package_version("loong-core")  # pyproject.toml's `version`, the one source
