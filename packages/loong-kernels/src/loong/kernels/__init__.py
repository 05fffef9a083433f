"""Loong kernels: fused Triton kernels, each beside its plain-PyTorch reference."""

__version__ = "0.1.0.dev0"
