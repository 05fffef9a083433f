"""The ``--device`` option of the commands that run models outside a training run (``preprocess``, ``sample``)."""

from __future__ import annotations

import torch

from loong.core.errors import LoongError


def cli_device(name: str) -> torch.device:
    """``--device NAME``: ``auto`` (CUDA when there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; a name
    that is not a device, or CUDA where there is none, fails naming the option."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LoongError(f"--device: {name!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LoongError(f"--device {name}: no CUDA device is available here")
    return device


__all__ = ["cli_device"]
