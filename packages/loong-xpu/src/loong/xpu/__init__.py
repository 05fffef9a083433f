"""Loong XPU: the Kunlun XPU accelerator plugin (``LOONG_ACCELERATOR=xpu``).

The accelerator lives in :mod:`loong.xpu.accelerator` and is found through the ``loong.accelerators``
entry point; importing this package imports neither torch nor Kunlun's runtime.
"""

__version__ = "0.1.0.dev0"
