"""Loong XPU: the Kunlun XPU accelerator plugin."""

__version__ = "0.1.0.dev0"
