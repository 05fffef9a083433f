"""The CPU accelerator: stock megatron-core (adapted) or torch FSDP2 on CPU with gloo, fp32."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from loong.core.accelerators.base import Accelerator


class CPUAccelerator(Accelerator):
    """Runs everything on the host. Used for smoke runs and for testing every layout in CI."""

    name = "cpu"
    device_type = "cpu"
    backend = "gloo"
    priority = 0
    env_vars = ("OMP_NUM_THREADS", "GLOO_*")

    @classmethod
    def is_available(cls) -> bool:
        return True

    def megatron_config_overrides(self) -> dict:
        # batch_p2p_comm=False: with PP=2 and virtual stages a rank's previous and next stage are the
        # same peer; gloo matches same-peer messages in posting order, and megatron's batched p2p
        # posts sends and receives in an order that swaps activations and gradients. The unbatched
        # path orders operations by rank parity, which matches on both sides.
        return {"use_cpu_initialization": True, "batch_p2p_comm": False}

    def capabilities(self) -> set[str]:
        return {"sdpa"}

    def fsdp_adaptations(self) -> dict[str, str]:
        # FSDP2's CPUOffloadPolicy pins its host shards by default, and pinning needs a CUDA driver
        return {"no_pinned_memory": "pinned host memory needs a CUDA driver: offloaded shards stay pageable"}

    @contextlib.contextmanager
    def activate(self, engine: str = "megatron") -> Iterator[None]:
        if engine != "megatron":  # the fsdp engine runs stock torch, which needs nothing adapted on CPU
            yield
            return
        from loong.core.accelerators.megatron_cpu import MegatronOnCPU

        with MegatronOnCPU():
            yield
