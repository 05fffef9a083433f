"""Fused weight-gradient accumulation for megatron's parallel linears, without APEX or Transformer Engine.

Megatron DDP keeps a ``main_grad`` buffer (fp32 unless ``train.grad_reduce_in_bf16``) per parameter. Without
``gradient_accumulation_fusion`` each linear's backward computes ``dW`` in the weight's dtype, hands it to autograd,
and DDP's hook adds it to ``main_grad`` in a second kernel that reads and writes the whole buffer again: on an H200
that add was 5.7% of an 8B-class step and 2.7% of a Qwen3-1.7B one (docs/performance.md, issue 26). Megatron fuses
the two only through APEX's ``fused_weight_gradient_mlp_cuda`` or TE's GEMM; here one GEMM writes the product
straight into ``main_grad`` (:func:`loong.kernels.mm_accumulate`: cuBLAS, bf16 operands, fp32 output, ``beta=1``),
and autograd gets megatron's placeholder (``grad_added_to_main_grad``), which the hook skips.

As with FP8, each layer keeps its module and parameters; only its class is swapped
(:mod:`~loong.core.engines.megatron.linear_swap`) for a subclass whose ``_forward_impl`` runs
:class:`FusedWgradLinearFunction`. A call the function does not implement (a weight that is not the layer's own;
an embedding-wgrad deferral buffer; GTP) runs megatron's own path, as do the output layer (tied to the embedding, or
its gradient made by the fused loss), FP8 layers (their own function) and Transformer Engine's (TE fuses this).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from loong.core.engines.megatron.linear_swap import is_te_linear, linear_call, restore_classes, with_mixin
from loong.core.engines.megatron.state import unwrap
from loong.core.precision.fp8_linear import (
    LinearComm,
    gather_sequence_parallel,
    main_grad_placeholder,
    reduce_dgrad,
)
from loong.kernels import mm_accumulate


class FusedWgradLinearFunction(torch.autograd.Function):
    """Autograd op ``Y = X·Wᵀ + b`` (megatron's linear with its TP communication) whose backward adds ``dW`` to
    ``weight.main_grad`` in the weight-gradient GEMM itself."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                comm: LinearComm) -> torch.Tensor:
        total = gather_sequence_parallel(x, comm.tp_group) if comm.sequence_parallel else x
        y = torch.matmul(total, weight.t())
        if bias is not None:
            y = y + bias
        # under SP the gathered input is gathered again in backward (megatron's memory choice), so keep the shard
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.comm, ctx.has_bias, ctx.x_shape = comm, bias is not None, x.shape
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        comm = ctx.comm
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = handle = None
        if need_dx:
            dx, handle = reduce_dgrad(torch.matmul(dy2, weight), comm)
        dw = None
        if need_dw:
            total = gather_sequence_parallel(x, comm.tp_group) if comm.sequence_parallel else x
            x2 = total.reshape(-1, total.shape[-1])
            main_grad = getattr(weight, "main_grad", None)
            if comm.gradient_accumulation_fusion and main_grad is not None:
                mm_accumulate(main_grad, dy2.t(), x2)
                dw = main_grad_placeholder(weight, dy.dtype)
            else:
                dw = torch.matmul(dy2.t(), x2)
        db = dy2.sum(0) if need_db and ctx.has_bias else None
        if handle is not None:
            handle.wait()
        if dx is not None:
            dx = dx.view(*ctx.x_shape)
        return dx, dw, db, None


class FusedWgradLinearMixin:
    """``_forward_impl`` through :class:`FusedWgradLinearFunction` for the layer's own weight; megatron's otherwise."""

    def _forward_impl(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        comm = linear_call(self, args, kwargs, fuse_wgrad=True)
        own = kwargs.get("weight") is getattr(self, "weight", None)  # a tied output layer gets the embedding's
        if comm is None or not own:
            return super()._forward_impl(*args, **kwargs)  # type: ignore[misc]
        return FusedWgradLinearFunction.apply(kwargs["input"], kwargs["weight"], kwargs.get("bias"), comm)


_FUSED_CLASSES: dict[type, type] = {}


def _skipped(module: torch.nn.Module) -> bool:
    """FP8 layers accumulate in their own function; TE's layers fuse this themselves; megatron's own fusion (APEX)
    needs nothing."""
    from loong.core.engines.megatron.fp8 import FP8LinearMixin

    return isinstance(module, FP8LinearMixin) or is_te_linear(module) \
        or bool(getattr(module, "gradient_accumulation_fusion", False))


def apply_wgrad_fusion(chunks: Iterable[torch.nn.Module]) -> int:
    """Swap every megatron parallel linear of ``chunks`` (before DDP wraps them) to the fused weight-gradient
    accumulation; returns how many layers were swapped."""
    n = 0
    for chunk in chunks:
        for name, module in unwrap(chunk).named_modules():
            # the output layer: its weight is tied to the embedding's, or its gradient comes from the fused loss
            # (loong-llm's GPTModel takes that path only for megatron's exact class)
            if name.rsplit(".", 1)[-1] == "output_layer":
                continue
            if isinstance(module, ColumnParallelLinear | RowParallelLinear) and not _skipped(module):
                module.__class__ = with_mixin(type(module), FusedWgradLinearMixin, "FusedWgrad", _FUSED_CLASSES)
                n += 1
    return n


def remove_wgrad_fusion(chunks: Iterable[torch.nn.Module]) -> int:
    """Swap every fused layer back to its original class; returns how many there were."""
    return len(restore_classes(chunks, FusedWgradLinearMixin))
