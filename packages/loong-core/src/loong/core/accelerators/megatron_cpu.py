"""The adaptations stock megatron-core needs to run on CPU under gloo.

megatron-core assumes CUDA in a handful of places that the training path reaches. Each adaptation
below names the site that needs it; all of them are applied together by :class:`MegatronOnCPU` on
entry and undone on exit, so nothing outside an active CPU run is changed. Measured on
megatron-core 0.19.2 (see ``shared/research/feasibility-uv-megatron.md``).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Adaptation:
    """Replace ``module.attr`` by ``make()`` while active. ``why`` names the megatron-core site."""

    module: str
    attr: str
    make: Callable[[], Any]
    why: str


def _cpu_rng_state(*_a: Any, **_k: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *_a: Any, **_k: Any) -> None:
    torch.set_rng_state(state)


def _seed_host(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


class _NoEvent:
    def synchronize(self) -> None: ...
    def wait(self, *_a: Any, **_k: Any) -> None: ...
    def record(self, *_a: Any, **_k: Any) -> None: ...
    def query(self) -> bool:
        return True


class _HostStream:
    """Stands in for a CUDA stream: on CPU every op is already ordered on the calling thread."""

    def __init__(self, *_a: Any, **_k: Any) -> None: ...
    def wait_stream(self, *_a: Any, **_k: Any) -> None: ...
    def wait_event(self, *_a: Any, **_k: Any) -> None: ...
    def synchronize(self) -> None: ...
    def record_event(self, *_a: Any, **_k: Any) -> _NoEvent:
        return _NoEvent()
    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HostStream)
    def __hash__(self) -> int:
        return 0


_HOST_STREAM = _HostStream()


def _die_with_parent() -> None:
    """Run in the queue's server process: exit when the training process dies, even by SIGKILL.

    Otherwise a killed run leaves the manager process behind, holding the run's stdout open.
    """
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _fork_results_queue(mp_mode: str = "fork") -> Any:
    import multiprocessing
    from multiprocessing.managers import SyncManager

    fa = importlib.import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")
    if fa._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(initializer=_die_with_parent)
        fa._results_queue = manager.Queue()
    return fa._results_queue


def _splits_to_numpy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


ADAPTATIONS: tuple[Adaptation, ...] = (
    Adaptation("torch.cuda", "current_device", lambda: (lambda: "cpu"),
               "utils.GlobalMemoryBuffer.get_tensor and TP mappings allocate on current_device()"),
    Adaptation("torch.cuda", "synchronize", lambda: (lambda *a, **k: None),
               "pipeline_parallel.p2p_communication._communicate synchronizes after batched p2p"),
    Adaptation("torch.cuda", "current_stream", lambda: (lambda *a, **k: _HOST_STREAM),
               "distributed.param_and_grad_buffer waits on the current stream around grad sync"),
    Adaptation("torch.cuda", "Stream", lambda: _HostStream,
               "distributed_data_parallel and the MoE all-to-all dispatcher create side streams"),
    Adaptation("torch.cuda", "Event", lambda: (lambda *a, **k: _NoEvent()),
               "param_and_grad_buffer / token dispatcher record events between streams"),
    Adaptation("torch.cuda", "stream", lambda: (lambda *a, **k: contextlib.nullcontext()),
               "token dispatcher enters `with torch.cuda.stream(...)`"),
    Adaptation("torch.cuda", "get_rng_state", lambda: _cpu_rng_state,
               "tensor_parallel.random.CudaRNGStatesTracker.add snapshots the device generator"),
    Adaptation("torch.cuda", "manual_seed", lambda: _seed_host,
               "CudaRNGStatesTracker.add seeds the device generator to make each named state; on CPU "
               "the host generator is the device one"),
    Adaptation("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", lambda: _cpu_rng_state,
               "tracker.fork() swaps generator states; on CPU the host generator is the device one"),
    Adaptation("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", lambda: _set_cpu_rng_state,
               "tracker.fork() restores generator states"),
    Adaptation("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
               lambda: _splits_to_numpy,
               "all-to-all splits must be numpy; upstream converts only tensors that are .is_cuda"),
    Adaptation("megatron.core.dist_checkpointing.strategies.filesystem_async", "get_write_results_queue",
               lambda: _fork_results_queue,
               "the async writer's 'spawn' Manager re-imports megatron in a child (25 s per save)"),
)


def _cpu_device(device: Any) -> Any:
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


class CudaCallsOnCPU(TorchFunctionMode):
    """Redirects CUDA placements made through torch functions to the CPU.

    megatron-core hard-codes ``device="cuda"`` in ~90 places (e.g. ``schedules.py`` token counters,
    ``optimizer.py`` scale tensors, ``clip_grads.py`` norms) and compares ``Tensor.type()`` with
    ``'torch.cuda.FloatTensor'`` (``distrib_optimizer.py``, ``optimizer.py``, ``clip_grads.py``).
    One torch-function mode handles all of them instead of one patch per site.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_cpu_device(kwargs["device"]))
        if kwargs.get("pin_memory"):  # needs a CUDA driver; e.g. the rotary embedding's CP slice pins its index
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device, int)):
            args = (args[0], _cpu_device(args[1]), *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and isinstance(result, str):
            result = result.replace("torch.", "torch.cuda.", 1) if ".cuda." not in result else result
        return result


class MegatronOnCPU(contextlib.AbstractContextManager):
    """Apply every adaptation on entry and restore the originals on exit (re-entrant safe)."""

    def __init__(self, adaptations: tuple[Adaptation, ...] = ADAPTATIONS) -> None:
        self.adaptations = adaptations
        # One frame per active entry (originals, record_stream, mode), so nesting one instance unwinds too.
        self._frames: list[tuple[list[tuple[Any, str, Any]], Any, CudaCallsOnCPU]] = []

    def __enter__(self) -> MegatronOnCPU:
        modules = [importlib.import_module(ad.module) for ad in self.adaptations]
        for ad, module in zip(self.adaptations, modules, strict=True):  # check all before patching any
            if not hasattr(module, ad.attr):
                raise RuntimeError(
                    f"megatron-core changed: {ad.module}.{ad.attr} is gone (needed because {ad.why})"
                )
        saved = []
        for ad, module in zip(self.adaptations, modules, strict=True):
            saved.append((module, ad.attr, getattr(module, ad.attr)))
            setattr(module, ad.attr, ad.make())
        saved_record_stream = torch.Tensor.record_stream
        torch.Tensor.record_stream = lambda self, *a, **k: None  # type: ignore[method-assign]
        mode = CudaCallsOnCPU()
        mode.__enter__()
        self._frames.append((saved, saved_record_stream, mode))
        return self

    def __exit__(self, *exc: Any) -> None:
        saved, saved_record_stream, mode = self._frames.pop()
        mode.__exit__(*exc)
        torch.Tensor.record_stream = saved_record_stream  # type: ignore[method-assign]
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)
