"""Loong embodied: vision-language-action policies (Pi0.5, GR00T N1.6) and LeRobot datasets."""

from importlib.metadata import version as _package_version

__version__ = _package_version("loong-embodied")  # pyproject.toml's `version`, the one source
