"""Layout-independent access to a megatron-core model's weights.

A model's ``sharded_state_dict()`` describes every local tensor as a slice of a global tensor
(layers stacked along a leading axis). These helpers move whole ("plain") tensors in and out of a
model at any TP/PP/EP layout: the same code loads a Hugging Face checkpoint into a TP=4 model and
gathers a PP=2 model's gradients for a parity test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

from loong.core.errors import LoongError


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The bare model inside DDP / Float16Module wrappers."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def sharded_tensors(model_chunks: Iterable[torch.nn.Module]) -> list[ShardedTensor]:
    """Every ShardedTensor of the model chunks, factories (e.g. SwiGLU fc1 split) applied."""
    out: list[ShardedTensor] = []
    for chunk in model_chunks:
        sd = unwrap(chunk).sharded_state_dict()
        apply_factories(sd)
        out.extend(v for v in nested_values(sd) if isinstance(v, ShardedTensor))
    return out


def _index(st: ShardedTensor) -> tuple:
    """The index of ``st``'s local data inside its global tensor."""
    p = st.prepend_axis_num
    idx: list = list(st.global_offset[:p])
    for offset, size in zip(st.global_offset[p:], st.local_shape, strict=True):
        idx.append(slice(offset, offset + size))
    return tuple(idx)


@torch.no_grad()
def load_full_state(model_chunks: Iterable[torch.nn.Module], full: Mapping[str, torch.Tensor],
                    select: Callable[[str], bool] | None = None) -> None:
    """Copy whole tensors ``full`` (keyed by sharded keys) into this rank's slices of the model.

    ``select(key)`` limits which of the model's tensors are loaded (default: all; each must be in ``full``).
    """
    tensors = [st for st in sharded_tensors(model_chunks) if select is None or select(st.key)]
    missing = sorted({st.key for st in tensors if st.key not in full})
    if missing:
        raise LoongError(f"weights missing for {len(missing)} tensors, e.g. {missing[:3]}")
    for st in tensors:
        src = full[st.key]
        if tuple(src.shape) != tuple(st.global_shape):
            raise LoongError(f"{st.key}: shape {tuple(src.shape)} != expected {tuple(st.global_shape)}")
        st.data.copy_(src[_index(st)].to(dtype=st.data.dtype, device=st.data.device))


@torch.no_grad()
def load_state_by_key(model_chunks: Iterable[torch.nn.Module], shapes: Mapping[str, tuple[int, ...]],
                      build: Callable[[str, int | None], torch.Tensor],
                      stacked: Callable[[str], bool] = lambda key: False,
                      progress: Any = None) -> None:
    """Copy whole tensors into this rank's slices of the model, each built when needed by ``build(key, layer)``:
    :func:`load_full_state` for a converter that streams, holding one native tensor at a time instead of all.

    ``shapes``: every native key's whole shape (the model may hold no tensor other than these). A key ``stacked``
    (layers on its leading axis) is built one layer at a time (``build(key, layer)`` returns ``tensor[layer]``),
    so even a layer-stacked tensor is never assembled; others as ``build(key, None)``. Keys and layers this rank
    holds no slice of are not built. ``progress``: a ``(bar, task)`` advanced by each tensor's elements (as
    :func:`~loong.core.checkpoint.safetensors_io.write_shards` takes it).
    """
    by_key: dict[str, list[ShardedTensor]] = {}
    for st in sharded_tensors(model_chunks):
        by_key.setdefault(st.key, []).append(st)
    unknown = sorted(set(by_key) - set(shapes))
    if unknown:
        raise LoongError(f"the model has tensors the mapping does not fill, e.g. {unknown[:3]}")

    def copy(st: ShardedTensor, part: torch.Tensor, first: int) -> None:
        p = st.prepend_axis_num  # leading axes indexed by an integer (layer, expert, ...); the rest are slices
        idx = tuple(st.global_offset[first:p]) + tuple(
            slice(o, o + n) for o, n in zip(st.global_offset[p:], st.local_shape, strict=True))
        st.data.copy_(part[idx].to(st.data.dtype))

    for key, shape in shapes.items():
        if progress is not None:
            progress[0].update(progress[1], name=key)
        held = by_key.get(key, [])
        if stacked(key):
            for layer in range(shape[0]):
                mine = [st for st in held if st.global_offset[0] == layer]
                if mine:
                    part = build(key, layer)
                    for st in mine:
                        copy(st, part, 1)
                    del part
        elif held:
            tensor = build(key, None)
            if tuple(tensor.shape) != tuple(shape):
                raise LoongError(f"{key}: shape {tuple(tensor.shape)} != expected {tuple(shape)}")
            for st in held:
                copy(st, tensor, 0)
            del tensor
        if progress is not None:
            progress[0].advance(progress[1], math.prod(shape))


def _view_on(tensor: torch.Tensor, base: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The view of ``other`` that ``tensor`` is of ``base`` (same strides, same relative offset)."""
    offset = tensor.storage_offset() - base.storage_offset()
    return other.as_strided(tensor.size(), tensor.stride(), other.storage_offset() + offset)


def gather_full_state(
    model_chunks: list[torch.nn.Module],
    source: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Assemble whole tensors from every rank's slices (collective over ``group``, default world).

    ``source(param)`` picks what to gather for each parameter (default: the weights themselves;
    e.g. ``lambda p: p.main_grad`` for gradients). Returns the full dict on every rank, on CPU, fp32.
    """
    spans = [
        (p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), p)
        for chunk in model_chunks
        for p in chunk.parameters()
    ]
    pieces = []
    for st in sharded_tensors(model_chunks):
        if not is_main_replica(st.replica_id):
            continue
        data = st.data
        if source is not None:
            param = next((p for lo, hi, p in spans if lo <= data.data_ptr() < hi), None)
            if param is None:
                continue  # a buffer, not a parameter
            other = source(param)
            if other is None:
                continue
            data = _view_on(data, param, other)
        pieces.append((st.key, tuple(st.global_shape), _index(st), data.detach().float().cpu()))
    gathered: list = [None] * (dist.get_world_size(group) if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, pieces, group=group)
    else:
        gathered = [pieces]
    full: dict[str, torch.Tensor] = {}
    for rank_pieces in gathered:
        for key, shape, idx, tensor in rank_pieces:
            if key not in full:
                full[key] = torch.zeros(shape)
            full[key][idx] = tensor
    return full
