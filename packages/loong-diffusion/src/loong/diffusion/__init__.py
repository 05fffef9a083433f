"""Loong diffusion: DiT families (Wan 2.x), latent video data and flow matching."""

from importlib.metadata import version as _package_version

__version__ = _package_version("loong-diffusion")  # pyproject.toml's `version`, the one source
