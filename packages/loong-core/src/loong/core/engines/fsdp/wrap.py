"""Recomputation, ``torch.compile`` and sharding, applied per block from outside the model (torchtitan's order:
checkpointing innermost, then compile, then ``fully_shard`` per block and once more on the root).

``model.recompute``:

- ``full``: each block keeps only its input; its whole forward runs again in the backward;
- ``selective``: each block's feed-forward part (``FSDPTask.mlp``) keeps only its input and runs again in the
  backward; the attention's activations, its output included, are kept. The MLP's activations are the largest
  (4x-wide hidden state) and the cheapest to recompute, attention the dearest.

Wrapping uses torch's ``checkpoint_wrapper``, whose module prefix torch's state-dict helpers strip, so checkpoint
keys do not change with ``model.recompute``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from loong.core.engines.fsdp.mesh import FSDPLayout
from loong.core.errors import LoongError

RECOMPUTE = ("none", "full", "selective")


def clean_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (what checkpoints and reports use)."""
    return name.replace(_CHECKPOINT_PREFIX, "").replace("_orig_mod.", "").removeprefix("module.")


def _replace(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` where ``old`` sits under ``root`` (by identity; a block may be reachable under one name only)."""
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is old:
                parent.register_module(name, new)
                return
    raise LoongError(f"cannot find the block {type(old).__name__} under the model to wrap it")


def apply_recompute(model: nn.Module, blocks: list[nn.Module], mode: str,
                    mlp_of: Callable[[nn.Module], nn.Module | None]) -> list[nn.Module]:
    """Wrap the blocks (``full``) or their MLPs (``selective``) in activation checkpointing; returns the blocks
    as they now sit in the model."""
    if mode == "none":
        return blocks
    out = []
    for block in blocks:
        if mode == "full":
            wrapped = checkpoint_wrapper(block)
            _replace(model, block, wrapped)
            out.append(wrapped)
            continue
        mlp = mlp_of(block)
        if mlp is None:
            raise LoongError(f"model.recompute=selective: block {type(block).__name__} has no feed-forward child "
                             "(mlp, ffn, ff, feed_forward); the task's mlp() names it, or use model.recompute=full")
        _replace(block, mlp, checkpoint_wrapper(mlp))
        out.append(block)
    return out


def apply_compile(blocks: list[nn.Module], options: dict[str, Any] | None = None) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile``: names and keys stay as they are), with the
    task's inductor ``options`` if it has any."""
    for block in blocks:
        block.compile(options=options or None)


def graph_breaks() -> dict[str, int]:
    """The graph breaks torch.compile recorded so far in this process, by reason."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def mixed_precision(dtype: torch.dtype, reduce_in_bf16: bool, cast_inputs: bool = True) -> MixedPrecisionPolicy:
    """bf16 compute from fp32 master weights; gradients reduced in fp32 unless ``train.grad_reduce_in_bf16``;
    ``cast_inputs``: FSDP2 casts the module's floating-point forward inputs to bf16."""
    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype if reduce_in_bf16 else torch.float32,
                                cast_forward_inputs=cast_inputs)


def shard(model: nn.Module, blocks: list[nn.Module], layout: FSDPLayout, dtype: torch.dtype,
          reduce_in_bf16: bool, pin_memory: bool = True, cast_root_inputs: bool = True) -> nn.Module:
    """FSDP2 (``parallel.fsdp=full|hybrid``) per block and on the root, or DDP (``none``); returns the model
    to train (the same module for FSDP2, a ``DistributedDataParallel`` wrapper for DDP). ``cast_root_inputs``
    (:attr:`FSDPTask.cast_root_inputs`): whether FSDP2 casts the root's float inputs to the compute dtype."""
    p = layout.config
    if p.fsdp == "none":
        device = next(model.parameters()).device
        ddp = DistributedDataParallel(model, process_group=layout.dp_cp_group,
                                      device_ids=[device.index] if device.type == "cuda" else None)
        if reduce_in_bf16:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            ddp.register_comm_hook(layout.dp_cp_group, bf16_compress_hook)
        return ddp
    kwargs: dict[str, Any] = {
        "mesh": layout.shard_mesh,
        "mp_policy": mixed_precision(dtype, reduce_in_bf16),
        "offload_policy": CPUOffloadPolicy(pin_memory=pin_memory) if p.fsdp_cpu_offload else OffloadPolicy(),
    }
    # A shard group of one rank holds whole parameters anyway: resharding after the forward would only copy them
    # out and back (and recast them to bf16) for the backward. Otherwise the last block's parameters are needed
    # again at once by the backward, so it keeps them.
    single = layout.shard_mesh.size(layout.shard_mesh.ndim - 1) == 1
    for i, block in enumerate(blocks):
        fully_shard(block, reshard_after_forward=not single and i < len(blocks) - 1, **kwargs)
    fully_shard(model, **{**kwargs, "mp_policy": mixed_precision(dtype, reduce_in_bf16, cast_root_inputs)})
    return model
