"""NVIDIA GPUs through CUDA and NCCL."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from loong.core.accelerators.base import Accelerator

# Dense bf16/fp16 tensor-core peaks per device (vendor datasheets, SXM parts, no sparsity).
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12,
              "A800": 312e12, "B200": 2250e12, "L40S": 362e12, "L4": 121e12}


class CUDAGraphBackend:
    """``torch.cuda.CUDAGraph`` capture for ``train.cuda_graphs`` (the fsdp engine's ``StepGraphs`` keeps the
    books): warm-up on a side stream, capture into a shared memory pool, replay; the random state of both the
    device's and the host's generator (a replay draws from the device's, advancing it as the eager step would)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def warmup(self, fn: Callable[[], Any], iters: int) -> None:
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(iters):
                fn()
        main.wait_stream(side)

    def capture(self, fn: Callable[[], Any], pool: Any | None) -> tuple[torch.cuda.CUDAGraph, Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        graph.replay()

    def pool(self, graph: torch.cuda.CUDAGraph) -> Any:
        return graph.pool()

    def rng_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cuda.get_rng_state(self.device), torch.get_rng_state()

    def set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        torch.cuda.set_rng_state(state[0], self.device)
        torch.set_rng_state(state[1])


class CUDAAccelerator(Accelerator):
    """CUDA devices: NCCL collectives, bf16 by default, memory and peak-FLOP reporting."""

    name = "cuda"
    device_type = "cuda"
    backend = "nccl"
    priority = 100
    env_vars = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING",
                "PYTORCH_CUDA_ALLOC_CONF", "NCCL_*", "TORCH_NCCL_*")

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if cls.is_available():
            return None
        if torch.version.cuda is None:
            return "this torch is a CPU-only build"
        return "torch.cuda.is_available() is False (no NVIDIA GPU or driver visible)"

    @classmethod
    def runtime_info(cls) -> dict[str, str]:
        info = {"torch CUDA build": torch.version.cuda or "none (CPU-only torch)"}
        if cls.is_available():
            info["devices"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
        return info

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank)

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def adam_implementation(self) -> str:
        # torch's fused CUDA AdamW: the foreach path allocates a full fp32 copy of the second moments per step
        # (25 GB for a 6.3B model) and took 10% of a 1B model's step on the H200 (docs/performance.md)
        return "fused"

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        name = torch.cuda.get_device_name()
        for key, flops in _PEAK_BF16.items():
            if key in name:
                return flops if dtype in (torch.bfloat16, torch.float16) else flops / 16
        return None

    def max_memory_allocated(self) -> int | None:
        return torch.cuda.max_memory_allocated()

    def graph_backend(self) -> CUDAGraphBackend:
        return CUDAGraphBackend(torch.device("cuda", torch.cuda.current_device()))

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def capabilities(self) -> set[str]:
        # flex_attention: torch.compile generates its kernels with Triton, which every CUDA build of torch ships
        caps = {"triton", "sdpa", "optimizer_offload", "flex_attention"}
        if importlib.util.find_spec("transformer_engine") is not None:
            caps.add("transformer_engine")
        if importlib.util.find_spec("flash_attn") is not None:
            caps.add("flash_attn")
        if torch.cuda.get_device_capability() >= (8, 9):
            caps.add("fp8")
        if torch.cuda.get_device_capability() >= (9, 0):  # torch's grouped GEMM kernels (CUTLASS) need Hopper
            caps.add("grouped_mm")
        return caps
