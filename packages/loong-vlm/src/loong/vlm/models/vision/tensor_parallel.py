"""Tensor parallelism for the vision encoders (``encoder.parallel.tp > 1``), applied from outside the plain modules.

:func:`shard_vision_encoder` takes a built encoder (any family: its ``blocks`` are
:class:`~loong.vlm.models.vision.common.VisionBlock` or InternViT's block, each with ``attn.qkv`` / ``attn.proj`` and
an ``mlp`` of ``fc1`` / ``fc2`` or ``gate_proj`` / ``up_proj`` / ``down_proj``) and the encoder's process group, and
shards every block Megatron-style: the fused ``qkv`` by columns (its rows are laid out per head, so a contiguous
shard holds whole heads), the output ``proj`` by rows (its output all-reduced over the group), the MLP's first
linear(s) by columns and its last by rows. Everything else (patch embedding, norms, layer scales, positions, the
projector) stays replicated. The group is held by the parallel layers themselves; nothing is global.

Parameters are marked as megatron-core's own tensor-parallel weights are (``tensor_model_parallel``,
``partition_dim``), so its gradient-norm computation counts each shard once per rank and a replicated weight once
(on tensor-parallel rank 0); shards duplicated in other encoder replicas of the model's tensor-parallel group are
marked ``shared`` and not counted again. :func:`shard_sharded_state_dict` gives the shards their global shape and
offset in the checkpoint (megatron ``dist_checkpointing``), so checkpoints, HF load / save and conversion see the
whole tensors at any encoder layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loong.core.errors import LoongError
from loong.vlm.models.config import EncoderConfig
from loong.vlm.models.vision.common import MLP, GatedMLP


def check_encoder_tp(cfg: EncoderConfig, tp: int, path: str = "encoder") -> None:
    """What sharding the encoder's blocks over ``tp`` ranks needs: whole heads and MLP columns on every rank, and
    no InternViT QK norm (an RMSNorm over *all* heads' queries, whose statistics would span the shards)."""
    if tp == 1:
        return
    if cfg.num_heads % tp:
        raise LoongError(f"{path}.parallel.tp={tp} must divide {path}.num_heads={cfg.num_heads} (each rank holds "
                         "whole attention heads)")
    if cfg.intermediate_size % tp:
        raise LoongError(f"{path}.parallel.tp={tp} must divide {path}.intermediate_size={cfg.intermediate_size} "
                         "(the MLP's inner width is split over the ranks)")
    if cfg.family == "intern_vit" and cfg.use_qk_norm:
        raise LoongError(f"{path}.parallel.tp={tp} with {path}.use_qk_norm=true is not supported (InternViT's QK "
                         f"norm normalises over all heads at once); use {path}.parallel.tp=1")


def _mark(param: nn.Parameter, dim: int, duplicate: bool) -> None:
    """megatron-core's tensor-parallel attributes: a shard along ``dim``; ``duplicate`` (the same shard is held by
    an encoder replica of a lower block) keeps the gradient norm from counting it twice."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    param.shared = duplicate


class _ShardedLinear(nn.Module):
    """This rank's slice of a linear layer's weight along ``dim`` (0: output features, 1: input features) over
    ``group``; the bias is sliced with the output features and whole with the input features."""

    def __init__(self, linear: nn.Linear, group: Any, duplicate: bool, dim: int) -> None:
        super().__init__()
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.out_features = linear.out_features // size if dim == 0 else linear.out_features
        self.in_features = linear.in_features // size if dim == 1 else linear.in_features
        width = linear.weight.shape[dim] // size
        shard = linear.weight.detach().narrow(dim, rank * width, width).clone()
        self.weight = nn.Parameter(shard, requires_grad=linear.weight.requires_grad)
        _mark(self.weight, dim, duplicate)
        self.bias = None
        if linear.bias is not None:
            bias = linear.bias.detach()
            bias = bias.narrow(0, rank * width, width) if dim == 0 else bias
            self.bias = nn.Parameter(bias.clone(), requires_grad=linear.bias.requires_grad)
            if dim == 0:
                _mark(self.bias, 0, duplicate)


class ColumnParallelLinear(_ShardedLinear):
    """The output features ``[rank * out / tp, (rank + 1) * out / tp)`` of a linear layer; the input's gradient is
    all-reduced over ``group`` (identity forward, sum backward)."""

    def __init__(self, linear: nn.Linear, group: Any, duplicate: bool) -> None:
        super().__init__(linear, group, duplicate, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        return F.linear(copy_to_tensor_model_parallel_region(x, group=self.group), self.weight, self.bias)


class RowParallelLinear(_ShardedLinear):
    """The input features ``[rank * in / tp, (rank + 1) * in / tp)`` of a linear layer: the partial products are
    all-reduced over ``group`` (sum forward, identity backward), then the (replicated) bias is added once."""

    def __init__(self, linear: nn.Linear, group: Any, duplicate: bool) -> None:
        super().__init__(linear, group, duplicate, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        out = reduce_from_tensor_model_parallel_region(F.linear(x, self.weight), group=self.group)
        return out if self.bias is None else out + self.bias


def _mlp_layers(mlp: nn.Module) -> tuple[tuple[str, ...], str]:
    """The names of an MLP's column-parallel (first) and row-parallel (last) linears."""
    if isinstance(mlp, GatedMLP):
        return ("gate_proj", "up_proj"), "down_proj"
    if isinstance(mlp, MLP):
        return ("fc1",), "fc2"
    raise LoongError(f"encoder tensor parallelism: no sharding plan for an MLP of type {type(mlp).__name__}")


def shard_vision_encoder(encoder: nn.Module, group: Any, replica: int = 0) -> nn.Module:
    """Shard ``encoder``'s blocks over ``group`` in place (see the module docstring) and return it.

    ``encoder`` holds its whole initial weights (the same on every rank); each rank keeps its slice. ``replica``:
    which encoder replica this rank's group is within the model's tensor-parallel group (0 for the first block of
    ranks): the shards of replicas > 0 are marked ``shared`` so the gradient norm counts every shard once.
    """
    blocks = getattr(encoder, "blocks", None)
    if blocks is None:
        raise LoongError(f"encoder tensor parallelism: {type(encoder).__name__} has no blocks to shard")
    size = dist.get_world_size(group)
    if size == 1:
        return encoder
    duplicate = replica > 0
    for i, block in enumerate(blocks):
        attn = block.attn
        if getattr(attn, "q_norm", None) is not None:
            raise LoongError(f"encoder block {i}: QK norm over all heads cannot be sharded by heads")
        if attn.qkv.out_features % (3 * attn.head_dim * size):
            raise LoongError(f"encoder block {i}: {attn.qkv.out_features // (3 * attn.head_dim)} heads do not "
                             f"split over {size} tensor-parallel ranks")
        attn.qkv = ColumnParallelLinear(attn.qkv, group, duplicate)
        attn.proj = RowParallelLinear(attn.proj, group, duplicate)
        columns, row = _mlp_layers(block.mlp)
        for name in columns:
            setattr(block.mlp, name, ColumnParallelLinear(getattr(block.mlp, name), group, duplicate))
        setattr(block.mlp, row, RowParallelLinear(getattr(block.mlp, row), group, duplicate))
    encoder.tensor_parallel_replica = replica  # the checkpoint's replica id of its shards
    return encoder


def _sharded_params(encoder: nn.Module) -> Iterator[tuple[str, nn.Parameter, Any]]:
    """``(name, parameter, group)`` of every sharded parameter of ``encoder`` (names as in its state dict)."""
    for name, module in encoder.named_modules():
        if isinstance(module, _ShardedLinear):
            for pname, param in module.named_parameters(recurse=False):
                if getattr(param, "tensor_model_parallel", False):
                    yield f"{name}.{pname}", param, module.group


def is_sharded(encoder: nn.Module | None) -> bool:
    """Whether :func:`shard_vision_encoder` sharded ``encoder`` over more than one rank."""
    return encoder is not None and hasattr(encoder, "tensor_parallel_replica")


def shard_sharded_state_dict(sd: dict, prefix: str, encoder: nn.Module) -> dict:
    """Replace, in megatron's sharded state dict ``sd``, the entries of ``encoder``'s shards (keys
    ``prefix + name``, made by megatron as replicated tensors) with ShardedTensors of the whole tensor: global
    shape, this rank's offset along the shard axis, replica id ``(0, replica, dp)`` (one main copy per shard: the
    first encoder replica's, data-parallel rank 0). The replicated tensors keep megatron's entries."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    replica = encoder.tensor_parallel_replica
    for name, param, group in _sharded_params(encoder):
        key = prefix + name
        old = sd.get(key)
        if not isinstance(old, ShardedTensor) or old.prepend_axis_num:
            raise LoongError(f"{key}: the sharded state dict has no plain tensor for this encoder shard")
        rid = old.replica_id if isinstance(old.replica_id, tuple) else (0, 0, old.replica_id)
        sd[key] = ShardedTensor.from_rank_offsets(
            key, param, (param.partition_dim, dist.get_rank(group), dist.get_world_size(group)),
            replica_id=(0, replica, rid[-1]))
    return sd


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "check_encoder_tp", "is_sharded", "shard_sharded_state_dict",
           "shard_vision_encoder"]
