"""The ``xpu`` accelerator: Kunlun XPUs through Kunlun's PyTorch runtime (``torch_xmlir``) and BKCL.

Selected with ``LOONG_ACCELERATOR=xpu``, or automatically where the runtime is installed. Without the
runtime it is never available, so installing loong-xpu changes nothing for CUDA or CPU users.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from loong.core.accelerators.base import Accelerator
from loong.core.accelerators.capabilities import SDPA, check_capabilities
from loong.core.errors import LoongError
from loong.xpu.env_defaults import environment_defaults
from loong.xpu.megatron import config_overrides
from loong.xpu.runtime import (
    RUNTIME_MODULE,
    Host,
    KunlunRuntime,
    ProcessHost,
    load_runtime,
    process_group_name,
    unavailable_reason,
)

#: Extra capability names to claim, comma-separated, for trying Kunlun's own ports on real hardware.
EXTRA_CAPABILITIES_VAR = "LOONG_XPU_EXTRA_CAPABILITIES"


class XPUAccelerator(Accelerator):
    """Kunlun XPUs (P800 generation), driven through ``torch.cuda`` as torch_xmlir presents them.

    ``host`` is where the runtime is looked up (the running process unless a test passes a simulation).
    Device methods need the runtime, so they work inside ``with accelerator.activate():``.
    """

    name = "xpu"
    # torch_xmlir takes over torch's CUDA device type; torch's own "xpu" type is Intel's GPUs.
    device_type = "cuda"
    # The name torch.distributed is given; torch_xmlir rewrites it to its BKCL process group.
    backend = "nccl"
    # Above cuda (100): on a Kunlun machine torch.cuda.is_available() is true too, and the cuda
    # accelerator would claim Triton, FP8 and NVIDIA peak FLOPs that the hardware lacks.
    priority = 150
    env_vars = ("XPU_*", "BKCL_*", "XMLIR_*", "XDNN_*", "XPYTORCH_*", "DISABLE_XPYTORCH", "LOG_SYMBOL_REPLACE",
                "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_DEVICE_ORDER")

    def __init__(self, host: Host | None = None) -> None:
        self._host: Host = host if host is not None else ProcessHost()
        self._runtime: KunlunRuntime | None = None

    @classmethod
    def is_available(cls) -> bool:
        return unavailable_reason(ProcessHost()) is None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return unavailable_reason(ProcessHost())

    @classmethod
    def runtime_info(cls) -> dict[str, str]:
        host = ProcessHost()
        origin = host.find_module(RUNTIME_MODULE)
        if origin is None:
            return {"runtime": f"{RUNTIME_MODULE} not installed"}
        return {"runtime": f"{RUNTIME_MODULE} at {origin}",
                "collectives": f"'nccl' routed by {RUNTIME_MODULE} to BKCL ({process_group_name(host.environ)})"}

    @property
    def runtime(self) -> KunlunRuntime:
        """The loaded runtime; only inside :meth:`activate`."""
        if self._runtime is None:
            raise RuntimeError("the xpu accelerator drives devices only inside `with accelerator.activate():`")
        return self._runtime

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device(self.device_type, local_rank)

    def set_device(self, local_rank: int) -> None:
        count = self.runtime.device_count
        if not 0 <= local_rank < count:
            raise LoongError(f"xpu: local rank {local_rank} but {count} Kunlun device(s) are visible; "
                             f"start at most {count} processes per node")
        self.runtime.device_module.set_device(local_rank)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.runtime.device_module.manual_seed_all(seed)

    def synchronize(self) -> None:
        self.runtime.device_module.synchronize()

    def default_dtype(self) -> torch.dtype:
        # P800 trains in bf16 (Baidu's Megatron scripts for it use --bf16); it has no FP8 (see capabilities).
        return torch.bfloat16

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        # No figure checked against a datasheet, so no MFU rather than a wrong one.
        return None

    def max_memory_allocated(self) -> int | None:
        # torch_xmlir keeps torch's own caching allocator, so torch.cuda's counters are the card's.
        return int(self.runtime.device_module.max_memory_allocated())

    def reset_peak_memory(self) -> None:
        self.runtime.device_module.reset_peak_memory_stats()

    def megatron_config_overrides(self) -> dict:
        return config_overrides()

    def capabilities(self) -> set[str]:
        """``sdpa`` only: every fused path falls back to its plain-PyTorch reference.

        Not claimed, and why: ``triton`` (loong-kernels' kernels target NVIDIA GPUs; Kunlun's own Triton
        build is untested with them), ``transformer_engine`` and ``flash_attn`` (Kunlun ships ports of
        both, untested with Loong; claim them with ``LOONG_XPU_EXTRA_CAPABILITIES=transformer_engine``
        to try), ``fp8`` (the P800 computes in fp32, fp16, bf16 and int8; FP8 recipes run in bf16).
        """
        extra = self._host.environ.get(EXTRA_CAPABILITIES_VAR, "")
        names = [n.strip() for n in extra.split(",") if n.strip()]
        return {SDPA} | check_capabilities(names, EXTRA_CAPABILITIES_VAR)

    @contextlib.contextmanager
    def activate(self, engine: str = "megatron") -> Iterator[None]:
        """Set the environment defaults, load and check the runtime; undo the defaults on exit.

        If the runtime cannot be used this raises before anything is initialised, with the
        environment as it was.
        """
        with environment_defaults(self._host.environ):
            runtime = load_runtime(self._host)
            previous, self._runtime = self._runtime, runtime
            try:
                yield
            finally:
                self._runtime = previous
