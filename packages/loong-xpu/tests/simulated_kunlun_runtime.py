"""SIMULATION of Kunlun's PyTorch runtime, for loong-xpu's tests only.

This is not Kunlun's code and drives no Kunlun device. It reproduces just the surface loong-xpu reads,
as docs/hardware.md describes the real runtime: a module named ``torch_xmlir`` whose ``__version__`` is
a mapping of components to versions, cards presented through a ``torch.cuda``-like module, and BKCL
process groups registered with ``torch.distributed`` as ``kccl`` / ``bccl``. Passing it as the
accelerator's ``host`` keeps the real ``os.environ``, ``torch.cuda`` and import system untouched.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from typing import Any

SIMULATED_ORIGIN = "/simulated/site-packages/torch_xmlir/__init__.py"


class SimulatedCuda:
    """Stands in for ``torch.cuda`` as torch_xmlir presents Kunlun cards; records what it is asked."""

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.calls: list[tuple[Any, ...]] = []
        self.peak_bytes = 0

    def is_available(self) -> bool:
        return self.devices > 0

    def device_count(self) -> int:
        return self.devices

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))

    def manual_seed_all(self, seed: int) -> None:
        self.calls.append(("manual_seed_all", seed))

    def synchronize(self) -> None:
        self.calls.append(("synchronize",))

    def max_memory_allocated(self) -> int:
        return self.peak_bytes

    def reset_peak_memory_stats(self) -> None:
        self.calls.append(("reset_peak_memory_stats",))
        self.peak_bytes = 0


class SimulatedKunlunHost:
    """A process with (or without) a simulated torch_xmlir; implements ``loong.xpu.runtime.Host``."""

    def __init__(self, installed: bool = True, devices: int = 8,
                 backends: tuple[str, ...] = ("gloo", "nccl", "ucc", "mpi", "kccl", "bccl"),
                 environ: dict[str, str] | None = None, import_error: Exception | None = None) -> None:
        self.installed = installed
        self.backends = backends
        self.environ: dict[str, str] = dict(environ or {})
        self.import_error = import_error
        self.cuda = SimulatedCuda(devices)
        self.imported: list[str] = []
        self.module = types.ModuleType("torch_xmlir")
        self.module.__file__ = SIMULATED_ORIGIN
        self.module.__version__ = OrderedDict([("XPyTorch", "3.2.0"), ("XRE", "5.0.21"), ("BKCL", "1.2.11")])

    def find_module(self, name: str) -> str | None:
        return SIMULATED_ORIGIN if self.installed and name == "torch_xmlir" else None

    def import_module(self, name: str) -> types.ModuleType:
        if not self.installed or name != "torch_xmlir":
            raise ModuleNotFoundError(f"No module named '{name}'")
        if self.import_error is not None:
            raise self.import_error
        self.imported.append(name)
        return self.module

    def device_module(self) -> SimulatedCuda:
        return self.cuda

    def registered_backends(self) -> list[str]:
        return list(self.backends)
