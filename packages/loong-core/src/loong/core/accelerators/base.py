"""The accelerator seam: everything hardware-specific lives behind this interface."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class Accelerator:
    """One kind of hardware. Subclasses are registered under entry-point group ``loong.accelerators``.

    Attributes:
        name: the value of ``LOONG_ACCELERATOR`` that selects it.
        device_type: the torch device type (``cuda``, ``cpu``, ...).
        backend: the torch.distributed backend (``nccl``, ``gloo``, ...).
        priority: higher wins when several are available and none is requested.
        env_vars: environment variables that configure this hardware, shown by ``loong env`` when set;
            an entry ending in ``*`` is a prefix (``NCCL_*``).

    ``is_available``, ``unavailable_reason`` and ``runtime_info`` are called for every installed
    accelerator (by the selection and by ``loong env``), so they must be cheap and change nothing:
    no device initialisation, no environment writes, no import of the hardware's runtime.
    """

    name: str = "base"
    device_type: str = "cpu"
    backend: str = "gloo"
    priority: int = 0
    env_vars: tuple[str, ...] = ()

    @classmethod
    def is_available(cls) -> bool:
        """Whether this hardware is usable in this process."""
        raise NotImplementedError

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when available; otherwise one line saying why not and, if it helps, what to install."""
        return None if cls.is_available() else "not available on this machine"

    @classmethod
    def runtime_info(cls) -> dict[str, str]:
        """A few cheap facts about the hardware's software stack, for ``loong env`` (no device init)."""
        return {}

    def device(self, local_rank: int = 0) -> torch.device:
        """The torch device that ``local_rank`` uses."""
        return torch.device(self.device_type)

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its device."""

    def manual_seed(self, seed: int) -> None:
        """Seed the host and device generators."""
        torch.manual_seed(seed)

    def synchronize(self) -> None:
        """Wait for queued device work (for timing)."""

    def default_dtype(self) -> torch.dtype:
        """The training dtype when ``train.precision=auto``."""
        return torch.float32

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """Dense peak FLOP/s of one device in ``dtype`` (for MFU); None when unknown."""
        return None

    def max_memory_allocated(self) -> int | None:
        """Peak bytes allocated on the device since the last reset; None when not tracked."""
        return None

    def reset_peak_memory(self) -> None:
        """Reset the peak-memory counter."""

    def adam_implementation(self) -> str:
        """torch AdamW's implementation for ``train.optimizer_impl=auto``: ``"foreach"`` or ``"fused"``."""
        return "foreach"

    def fsdp_adaptations(self) -> dict[str, str]:
        """What the ``fsdp`` engine must do differently on this hardware, as ``{switch: why}`` (one place per
        accelerator; see ``loong.core.engines.fsdp``). Known switches: ``no_fused_adam`` (torch's fused AdamW has
        no kernel here), ``compile_unsupported`` (``torch.compile`` cannot build for this device),
        ``no_pinned_memory`` (host memory cannot be pinned: offloaded shards stay pageable)."""
        return {}

    def graph_backend(self) -> Any | None:
        """What ``train.cuda_graphs`` captures and replays with on this hardware (a
        :class:`loong.core.engines.fsdp.cuda_graph.GraphBackend`), or None when the hardware has no graphs."""
        return None

    def megatron_config_overrides(self) -> dict:
        """TransformerConfig fields this hardware needs (e.g. initialising weights on the host)."""
        return {}

    def capabilities(self) -> set[str]:
        """Optional features present, named from :data:`loong.core.accelerators.capabilities.CAPABILITIES`.

        Models take a fused path only when its name is here and fall back to the references otherwise.
        """
        return set()

    @contextlib.contextmanager
    def activate(self, engine: str = "megatron") -> Iterator[None]:
        """Enter the state the training stack needs on this hardware (adaptations, modes) for ``engine``'s
        libraries (megatron-core's adaptations are entered only for the ``megatron`` engine)."""
        yield

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
