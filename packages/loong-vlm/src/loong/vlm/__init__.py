"""Loong VLM: vision encoders, projectors and VLM assembly over loong-llm foundations."""

from importlib.metadata import version as _package_version

__version__ = _package_version("loong-vlm")  # pyproject.toml's `version`, the one source
