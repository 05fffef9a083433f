"""The CPU accelerator: stock megatron-core on CPU with gloo, fp32."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from loong.core.accelerators.base import Accelerator


class CPUAccelerator(Accelerator):
    """Runs everything on the host. Used for smoke runs and for testing every layout in CI."""

    name = "cpu"
    device_type = "cpu"
    backend = "gloo"
    priority = 0

    @classmethod
    def is_available(cls) -> bool:
        return True

    def megatron_config_overrides(self) -> dict:
        return {"use_cpu_initialization": True}

    def capabilities(self) -> set[str]:
        return {"sdpa"}

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        from loong.core.accelerators.megatron_cpu import MegatronOnCPU

        with MegatronOnCPU():
            yield
