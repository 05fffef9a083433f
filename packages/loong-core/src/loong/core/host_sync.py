"""Find the ops that make the host wait for the device, or that a CUDA graph cannot capture, on any machine.

On a GPU, a few kinds of op copy a data-dependent value back to the host (``item``, ``nonzero``, boolean
indexing, ``repeat_interleave`` without ``output_size``, ...): the host stops launching until the device catches
up, and none of them can run inside a CUDA-graph capture. Another kind makes a tensor from host data
(``torch.tensor(...)``: ``aten.lift_fresh``), which on a GPU is a host-to-device copy, again not capturable, and
whose value a replayed graph would never see change. These ops are recognisable by name on the CPU too, where they
cost nothing, so a CPU test can check a model's forward and backward for them: :class:`DeviceSyncRecorder` is a
dispatch mode that records each such op with the Loong source lines that called it while :attr:`active` is set.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
#: ops whose CUDA kernels copy a data-dependent value (a count, a scalar) back to the host
SYNC_OPS = frozenset({aten._local_scalar_dense, aten.item, aten.nonzero, aten.equal, aten.masked_select,
                      aten.is_nonzero, aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
                      aten.bincount, aten.masked_scatter_backward})
#: ops that make a tensor from host data (a host-to-device copy on a GPU)
HOST_DATA_OPS = frozenset({aten.lift_fresh, aten.lift_fresh_copy})
_INDEX_OPS = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def syncs_on_device(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the aten op ``func`` called with ``args`` / ``kwargs`` waits for the device on a GPU."""
    packet = func.overloadpacket
    return (packet in SYNC_OPS
            or (packet in _INDEX_OPS and _bool_index(args))
            or (packet is aten.repeat_interleave and kwargs.get("output_size") is None
                and isinstance(args[0], torch.Tensor) and len(args) < 4))


class DeviceSyncRecorder(TorchDispatchMode):
    """Records, while :attr:`active`, the ops that sync the device (:attr:`seen`) and, with ``host_data=True``,
    those that make a tensor from host data as well.

    ``other_paths``: source paths (substrings) of code the CPU runs where a GPU takes another path (a reference
    kernel, say); an op called from one of them is put in :attr:`other_paths_seen` instead. ``root``: the path
    fragment of the frames listed with each op (default ``/loong/``).
    """

    def __init__(self, *, other_paths: Sequence[str] = (), host_data: bool = False, root: str = "/loong/") -> None:
        super().__init__()
        self.active = False
        self.seen: list[str] = []
        self.other_paths_seen: set[str] = set()
        self._other_paths, self._host_data, self._root = tuple(other_paths), host_data, root

    def _record(self, func: Any) -> None:
        frames = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()]
        path = next((p for p in self._other_paths for f in frames if p in f), None)
        if path is not None:
            self.other_paths_seen.add(f"{func} in {path}")
        else:
            self.seen.append(f"{func} at {' < '.join(f for f in frames[::-1] if self._root in f)[:300]}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if self.active and (syncs_on_device(func, args, kwargs)
                            or (self._host_data and func.overloadpacket in HOST_DATA_OPS)):
            self._record(func)
        return func(*args, **kwargs)


__all__ = ["HOST_DATA_OPS", "SYNC_OPS", "DeviceSyncRecorder", "syncs_on_device"]
