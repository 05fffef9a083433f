"""Hooks for every test of the workspace (``packages/*/tests`` and ``tests/``).

GPU tests (``-m gpu``) run one after another in one process on one accelerator. torch's caching allocator keeps
what a test freed reserved for the process, so after the DSA kernels' 2**31-element tensors the next test's NCCL
init, a spilling Triton kernel's local memory or a worker subprocess found the GPU full (out of memory in the
middle of an otherwise passing suite). Each GPU test therefore gives its cached blocks back when it ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _release_accelerator_memory(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if request.node.get_closest_marker("gpu") is None:
        return
    import torch

    gc.collect()  # a failed test's traceback frames can still hold its tensors
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
