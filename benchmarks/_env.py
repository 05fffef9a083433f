"""What every benchmark records beside its figures: package versions and the machine."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path


def versions(names: list[str]) -> dict:
    """Python's version and each installed distribution's (None when absent)."""
    out: dict = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def host() -> dict:
    """CPU model and count, platform, load average, and the GPUs torch sees (if torch is importable)."""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"cpu": model, "cpu_count": os.cpu_count(), "platform": platform.platform(),
           "load_average_before": os.getloadavg()}
    try:
        import torch
    except ImportError:
        return out
    if torch.cuda.is_available():
        out.update(gpu=torch.cuda.get_device_name(), gpu_count=torch.cuda.device_count(),
                   gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return out
