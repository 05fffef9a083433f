"""How a public kernel picks its implementation: Triton on CUDA, the plain-PyTorch reference otherwise.

Every public function takes ``backend``:

- ``"auto"`` (default): the Triton kernel when Triton is importable, every tensor is on a CUDA device and
  the input is one the kernel supports; otherwise the reference. Falling back is always correct, only
  slower, so ``auto`` never refuses an input the reference can compute.
- ``"triton"``: the Triton kernel or a :class:`KernelUnsupportedError` saying why not. Under Triton's
  interpreter (``TRITON_INTERPRET=1``) CPU tensors are accepted too; that is how the CPU tests run the
  kernels. ``auto`` never picks the interpreter by itself: a leaked ``TRITON_INTERPRET`` must not turn a
  CPU training run into a Python-speed one.
- ``"reference"``: the plain-PyTorch twin.

Kernels are wrapped by :func:`kernel`, which decides between compiled and interpreted Triton at *launch*
time rather than at import time, so tests may switch the interpreter on with ``monkeypatch.setenv``
whatever imported this package first.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch

Backend = Literal["auto", "triton", "reference"]
_BACKENDS = ("auto", "triton", "reference")


class KernelUnsupportedError(ValueError):
    """Raised when ``backend="triton"`` is asked for an input the Triton kernel does not support."""


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (it ships with PyTorch's Linux wheels; macOS has none)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter is switched on now (read as Triton reads it, at each launch)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def use_triton(backend: str, name: str, tensors: Iterable[torch.Tensor | None], why_not: str | None = None) -> bool:
    """Decide Triton vs reference for one call.

    ``why_not`` is the kernel's own reason it cannot take this input (dtype, size, layout), or None.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"{name}: backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "reference":
        return False
    reason = why_not
    if reason is None and not triton_available():
        reason = "Triton is not installed"
    if reason is None:
        devices = {t.device.type for t in tensors if t is not None}
        if backend == "auto" and devices != {"cuda"}:
            reason = f"tensors on {sorted(devices)}, the Triton path is taken automatically on CUDA only"
        elif backend == "triton" and not devices <= {"cuda"} and not (interpreting() and devices <= {"cpu"}):
            reason = (f"tensors on {sorted(devices)}: the Triton kernel needs CUDA tensors "
                      "(or CPU tensors under TRITON_INTERPRET=1)")
    if reason is None:
        return True
    if backend == "triton":
        raise KernelUnsupportedError(f"{name}: {reason}")
    return False


def check_float(name: str, t: torch.Tensor, what: str,
                dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)) -> str | None:
    """A reason string if ``t``'s dtype is not one the kernel handles, else None."""
    if t.dtype not in dtypes:
        return f"{what} has dtype {t.dtype}; the Triton kernel takes {', '.join(str(d) for d in dtypes)}"
    return None


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small number under the interpreter, to keep tests quick
    while still splitting the work between several programs)."""
    if device.type != "cuda":
        return 3
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _patch_interpreter_index() -> None:
    """Let Triton's interpreter use scalar arguments as loop bounds under NumPy >= 2.5.

    The interpreter keeps every scalar as a one-element 1-D array and implements ``__index__`` as
    ``int(array)``, which NumPy 2.5 refuses for arrays with a dimension. Loops such as
    ``for off in range(0, n_cols, BLOCK)`` then fail under the interpreter only. Compiled kernels are
    unaffected; this touches the interpreter's tensor patching and nothing else.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


@contextlib.contextmanager
def _jit_calls_interpreted() -> Iterator[None]:
    """Run ``@triton.jit`` helpers (``tl.sum``, ``tl.sigmoid``, ...) as interpreted code during a launch.

    Triton decides at *import* time whether its standard-library helpers are compiled-mode
    ``JITFunction`` objects or interpreted ones; when ``triton.language`` was imported before
    ``TRITON_INTERPRET=1`` was set (megatron-core imports it, so any process that loaded megatron first),
    calling them from interpreted code raises. For the length of one interpreted launch, such calls go
    through an ``InterpretedFunction`` of the same Python function instead.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__
    cache: dict[int, InterpretedFunction] = {}

    def call(self, *args, **kwargs):
        fn = cache.get(id(self))
        if fn is None:
            fn = cache[id(self)] = InterpretedFunction(self.fn)
        return fn(*args, **kwargs)

    JITFunction.__call__ = call
    try:
        yield
    finally:
        JITFunction.__call__ = original


class _Kernel:
    """A Triton kernel that is jitted or interpreted according to ``TRITON_INTERPRET`` at launch."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._jit: Any = None
        self._interpreted: Any = None
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        if interpreting():
            if self._interpreted is None:
                from triton.runtime.interpreter import InterpretedFunction

                _patch_interpreter_index()
                self._interpreted = InterpretedFunction(self.fn)
            f = self._interpreted

            def launch(*args: Any, **kwargs: Any) -> Any:
                with _jit_calls_interpreted():
                    return f[grid](*args, **kwargs)

            return launch
        if self._jit is None:
            from triton.runtime.jit import JITFunction

            self._jit = JITFunction(self.fn)
        return self._jit[grid]


def kernel(fn: Callable[..., Any]) -> _Kernel:
    """Decorator for Triton kernels in this package (use instead of ``@triton.jit``; no nested jit calls)."""
    return _Kernel(fn)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def warps_for(block: int) -> int:
    """Warps for a row-wise kernel over ``block`` elements: enough lanes to hold the row in registers."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4
