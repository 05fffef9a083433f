"""Loong core: registry, config, accelerators, parallel layouts, engines, trainer, checkpoints, CLI kit."""

__version__ = "0.1.0.dev0"
