"""Loong XPU: the Kunlun XPU accelerator plugin (``LOONG_ACCELERATOR=xpu``).

The accelerator lives in :mod:`loong.xpu.accelerator` and is found through the ``loong.accelerators``
entry point; importing this package imports neither torch nor Kunlun's runtime.
"""

from importlib.metadata import version as _package_version

__version__ = _package_version("loong-xpu")  # pyproject.toml's `version`, the one source
