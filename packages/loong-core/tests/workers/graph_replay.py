"""A graph backend for the CPU tests of ``train.cuda_graphs``: it "captures" by remembering the step and replays by
running it again, copying the result into the captured output. Everything the engine's ``StepGraphs`` does around
a capture (input buffers, the flat gradient buffer, restoring the gradients and the random state after the
warm-up, the data-parallel all-reduce) is thereby exercised on the CPU; the capture itself needs a GPU
(``test_gpu_cuda_graphs.py``). A backend that runs the step when capturing is allowed by ``GraphBackend``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from loong.core.accelerators.cpu import CPUAccelerator


class EagerReplayBackend:
    """Replays by calling the remembered step; counts what it did."""

    def __init__(self) -> None:
        self.warmups = self.captures = self.replays = 0

    def warmup(self, fn: Callable[[], Any], iters: int) -> None:
        for _ in range(iters):
            fn()
            self.warmups += 1

    def capture(self, fn: Callable[[], Any], pool: Any | None) -> tuple[Any, Any]:
        self.captures += 1
        out = fn()
        return (fn, out), out

    def replay(self, graph: Any) -> None:
        fn, out = graph
        self.replays += 1
        out.copy_(fn())

    def pool(self, graph: Any) -> Any:
        return None

    def rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)


class ReplayingCPUAccelerator(CPUAccelerator):
    """The CPU accelerator with :class:`EagerReplayBackend` as its graph capture."""

    def graph_backend(self) -> EagerReplayBackend:
        return EagerReplayBackend()
