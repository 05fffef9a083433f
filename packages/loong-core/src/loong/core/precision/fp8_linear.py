"""The FP8 linear: ``Y = X·Wᵀ (+ b)`` with its three GEMMs on fp8 operands, and megatron's TP plumbing.

``fp8_mm(a, b)`` computes ``a·bᵀ`` of two :class:`~loong.core.precision.recipes.Quantized` matrices:

- ``native``: ``torch._scaled_mm`` (tensorwise: cuBLASLt; rowwise: torch's CUTLASS kernel) and, for
  blockwise, ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` / ``BlockWise128x128`` scales, which
  torch 2.11 implements only through cuBLASLt >= 12.9 on sm90 (Hopper: H100/H200); elsewhere it raises.
  :func:`native_support` says which combinations run on a device (blockwise is probed once per device).
- ``emulated``: dequantise both operands and run an ordinary matmul: the same products of the same fp8
  values and scales, so the same result up to accumulation order (the CPU tests, and any GEMM a GPU cannot
  run natively: slower than bf16, numerics only).

:class:`FP8LinearFunction` is megatron-core 0.19's ``LinearWithGradAccumulationAndAsyncCommunication``
with the three GEMMs in fp8: the sequence-parallel all-gather of ``X`` in forward (and again in
backward), the input-gradient all-reduce or reduce-scatter over the TP group, and the weight gradient
either returned to autograd (megatron DDP's hook adds it to ``main_grad``) or, with
``gradient_accumulation_fusion``, added to ``main_grad`` here. Bias and its gradient stay in high precision.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loong.core.precision.recipes import FP8Recipe, Quantized, quantize, transposable

_NATIVE_BLOCKWISE = (("1x128", "128x128"), ("1x128", "1x128"))


def _native_shape_ok(a: Quantized, b: Quantized) -> bool:
    """``_scaled_mm``'s layout rules: the contraction and B's rows multiples of 16; with block scales the
    contraction and 128x128-scaled rows multiples of 128 (whole blocks) and A's rows of 16."""
    (ra, k), rb = a.data.shape, b.data.shape[0]
    if a.granularity not in ("1x128", "128x128"):
        return k % 16 == 0 and rb % 16 == 0
    return k % 128 == 0 and ra % 16 == 0 and rb % (128 if b.granularity == "128x128" else 16) == 0


def _scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``a·bᵀ`` on the GPU's fp8 tensor cores (A row-major, B column-major, fp32 scales)."""
    ga, gb = a.granularity, b.granularity
    if (ga, gb) == ("tensor", "tensor"):
        return torch._scaled_mm(a.data, b.data.t(), a.scale, b.scale, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    if (ga, gb) == ("row", "row"):  # scale_a [M, 1], scale_b [1, N]
        return torch._scaled_mm(a.data, b.data.t(), a.scale, b.scale.reshape(1, -1), out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    if (ga, gb) in _NATIVE_BLOCKWISE:
        import torch.nn.functional as F

        st = F.ScalingType
        # 1x128 scales of an operand: [rows, K/128] stored outer-dim-major (stride [1, rows]), as
        # torch's meta for scaled_mm checks
        sa = a.scale.t().contiguous().t()
        if gb == "1x128":
            sb, recipe_b = b.scale.t().contiguous().t(), st.BlockWise1x128
        else:  # 128x128 tiles of mat2 [K, N]: [round_up(K/128, 4), N/128], stride [1, L4]
            kb = b.scale.shape[1]
            padded = torch.ones(b.scale.shape[0], -(-kb // 4) * 4, dtype=torch.float32, device=b.scale.device)
            padded[:, :kb] = b.scale
            sb, recipe_b = padded.t(), st.BlockWise128x128
        return F.scaled_mm(a.data, b.data.t(), sa, st.BlockWise1x128, sb, recipe_b, output_dtype=out_dtype)
    raise ValueError(f"no fp8 GEMM for granularities ({ga}, {gb})")


def _emulated_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.Tensor:
    return (a.dequantize(compute_dtype) @ b.dequantize(compute_dtype).t()).to(out_dtype)


@functools.cache
def _blockwise_supported(device: torch.device, combo: tuple[str, str]) -> bool:
    """Whether ``combo`` runs natively on ``device`` and agrees with the emulation (probed once)."""
    g = torch.Generator(device=device).manual_seed(0)
    # not square, and K/128 = 2 blocks, so that a transposed or unpadded scale layout shows as a mismatch
    x = torch.randn(384, 256, device=device, generator=g, dtype=torch.bfloat16)
    w = torch.randn(512, 256, device=device, generator=g, dtype=torch.bfloat16)
    x[:128] *= 100.0  # distinct block scales
    a, b = quantize(x, combo[0]), quantize(w, combo[1])
    try:
        y = _scaled_mm(a, b, torch.bfloat16, False).float()
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    ref = _emulated_mm(a, b, torch.float32, torch.float32)
    return bool(((y - ref).norm() / ref.norm()) < 1e-2)


def native_support(device: torch.device | str) -> dict[str, bool]:
    """Which fp8 GEMMs run natively on ``device``: keys ``tensorwise``, ``rowwise``, ``blockwise_fwd``
    (1x128 x 128x128: forward and dgrad) and ``blockwise_wgrad`` (1x128 x 1x128)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return dict.fromkeys(("tensorwise", "rowwise", "blockwise_fwd", "blockwise_wgrad"), False)
    return {"tensorwise": True, "rowwise": True,
            "blockwise_fwd": _blockwise_supported(device, ("1x128", "128x128")),
            "blockwise_wgrad": _blockwise_supported(device, ("1x128", "1x128"))}


_warned: set[tuple] = set()


def fp8_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, *, native: bool = True, fast_accum: bool = False,
           emulate_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a·bᵀ`` for ``a`` [M, K] and ``b`` [N, K] quantised along K; returns [M, N] in ``out_dtype``.

    ``native=True`` runs ``_scaled_mm`` where the device and shapes allow it and emulates (with a one-time
    warning) where they do not; ``native=False`` always emulates. Emulation computes in
    ``emulate_dtype`` (default: fp32 on CPU, bf16 on GPU, where it only stands in for a missing kernel).
    """
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"fp8_mm: contraction dims differ: {tuple(a.data.shape)} x {tuple(b.data.shape)}ᵀ")
    if native and a.data.is_cuda:
        combo = (a.granularity, b.granularity)
        key = "blockwise_wgrad" if combo == ("1x128", "1x128") else "blockwise_fwd"
        ok = combo not in _NATIVE_BLOCKWISE or native_support(a.data.device)[key]
        if ok and _native_shape_ok(a, b):
            return _scaled_mm(a, b, out_dtype, fast_accum)
        why = (combo, tuple(a.data.shape), tuple(b.data.shape))
        if why not in _warned:
            _warned.add(why)
            warnings.warn(f"fp8 GEMM {combo[0]} x {combo[1]} of {tuple(a.data.shape)} x {tuple(b.data.shape)}ᵀ is "
                          "emulated (dequantise + matmul): " + ("the device has no native kernel for it" if not ok
                          else "a dimension is not a multiple of 16 (128 for block scales)"), stacklevel=2)
    compute = emulate_dtype or (torch.bfloat16 if a.data.is_cuda else torch.float32)
    return _emulated_mm(a, b, out_dtype, compute)


@dataclass(frozen=True)
class LinearComm:
    """The parts of megatron's linear call that are not the GEMMs.

    Attributes:
        sequence_parallel: all-gather ``X`` over ``tp_group`` (dim 0) in forward; reduce-scatter ``dX``.
        allreduce_dgrad: all-reduce ``dX`` over ``tp_group`` (column-parallel without SP).
        tp_group: the tensor-parallel group (needed only by the two above).
        gradient_accumulation_fusion: add ``dW`` to ``weight.main_grad`` here instead of returning it.
    """

    sequence_parallel: bool = False
    allreduce_dgrad: bool = False
    tp_group: Any = None
    gradient_accumulation_fusion: bool = False


def gather_sequence_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` all-gathered over ``group`` along dim 0 (megatron's sequence-parallel input of a column linear)."""
    out = torch.empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def reduce_dgrad(dx: torch.Tensor, comm: LinearComm) -> tuple[torch.Tensor, Any]:
    """Start ``dX``'s (``[tokens, K]``) tensor-parallel collective: a reduce-scatter to this rank's rows under SP, an
    all-reduce with ``allreduce_dgrad``; asynchronous, so it overlaps the weight-gradient GEMM, as in megatron.
    Returns this rank's ``dX`` (valid once the handle is waited on) and the handle (None: no collective)."""
    if comm.sequence_parallel:
        out = torch.empty((dx.shape[0] // dist.get_world_size(comm.tp_group), dx.shape[1]), dtype=dx.dtype,
                          device=dx.device)
        return out, dist.reduce_scatter_tensor(out, dx, group=comm.tp_group, async_op=True)
    if comm.allreduce_dgrad:
        return dx, dist.all_reduce(dx, group=comm.tp_group, async_op=True)
    return dx, None


def _quantize_t(saved: Quantized | None, full: torch.Tensor | None, granularity: str, dtype: torch.dtype) -> Quantized:
    """The quantised transpose: from the forward's quantisation when it is transposable, else anew."""
    if saved is not None:
        return saved.t()
    assert full is not None
    return quantize(full.t(), granularity, dtype)  # type: ignore[arg-type]


def pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t`` [M, C] with zero rows appended up to a multiple of ``multiple`` rows (fp8 data too: its zero is the
    all-zero byte)."""
    pad = -t.shape[0] % multiple
    if not pad:
        return t
    if t.element_size() == 1 and t.is_floating_point():  # fp8: pad the bytes
        return torch.nn.functional.pad(t.view(torch.uint8), (0, 0, 0, pad)).view(t.dtype)
    return torch.nn.functional.pad(t, (0, 0, 0, pad))


def _wgrad_operands(dy2: torch.Tensor, dyq: Quantized | None, x2: torch.Tensor | None, xq: Quantized | None,
                    recipe: FP8Recipe, pad: bool) -> tuple[Quantized, Quantized]:
    """``dYᵀ`` [N, M] and ``Xᵀ`` [K, M] quantised for the weight-gradient GEMM, whose contraction is the token
    count M. ``_scaled_mm`` needs M a multiple of 16 (128 under block scales), which a variable number of tokens
    per micro-batch often is not; with ``pad`` both are padded with zero tokens first. Zeros change no amax, so
    every real element quantises to the same bits, and they add nothing to dW: the GEMM runs natively instead of
    being emulated. ``dyq`` / ``xq``: the forward's (or dgrad's) quantisation when it is transposable, else None
    (then quantised anew from ``dy2`` / ``x2``)."""
    multiple = 128 if "1x128" in (recipe.grad, recipe.activation) else 16
    m = multiple if pad else 1

    def operand(q: Quantized | None, full: torch.Tensor | None, granularity: str, dtype: torch.dtype) -> Quantized:
        if q is not None:
            return Quantized(pad_rows(q.data, m), q.scale, q.granularity).t()
        assert full is not None
        return quantize(pad_rows(full, m).t(), granularity, dtype)  # type: ignore[arg-type]

    return (operand(dyq, dy2, recipe.grad, recipe.grad_dtype),
            operand(xq, x2, recipe.activation, recipe.fwd_dtype))


def _a_rows(recipe: FP8Recipe, native: bool) -> int:
    """What the token count of the forward and dgrad GEMMs' A operand must divide by for ``_scaled_mm``: 16 with
    block scales, else anything (:func:`_native_shape_ok`); on the native path those operands are padded to it."""
    return 16 if native and recipe.activation == "1x128" else 1


class FP8LinearFunction(torch.autograd.Function):
    """Autograd op ``Y = X·Wᵀ + b`` with fp8 GEMMs; the TP communication of megatron's linear."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: FP8Recipe,
                comm: LinearComm, native: bool) -> torch.Tensor:
        total = gather_sequence_parallel(x, comm.tp_group) if comm.sequence_parallel else x
        k = total.shape[-1]
        x2 = total.reshape(-1, k)
        xq = quantize(pad_rows(x2, _a_rows(recipe, native)), recipe.activation, recipe.fwd_dtype)
        wq = quantize(weight, recipe.weight, recipe.fwd_dtype)
        y = fp8_mm(xq, wq, x.dtype, native=native, fast_accum=recipe.fast_accum_forward)[: x2.shape[0]]
        if bias is not None:
            y = y + bias
        need_dw = weight.requires_grad
        # What backward needs: Xᵀ quantised for the wgrad GEMM is either the forward's Xq transposed
        # (tensorwise, and only without SP, where X must be gathered again anyway) or a new quantisation
        # of X, which is then kept in high precision, as megatron keeps it.
        keep_xq = need_dw and transposable(recipe.activation) and not comm.sequence_parallel
        keep_x = need_dw and not keep_xq
        keep_wq = transposable(recipe.weight)
        tensors = [x if keep_x else None, xq.data if keep_xq else None, xq.scale if keep_xq else None,
                   weight, wq.data if keep_wq else None, wq.scale if keep_wq else None]
        ctx.save_for_backward(*tensors)
        ctx.recipe, ctx.comm, ctx.native = recipe, comm, native
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return y.view(*total.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, xq_data, xq_scale, weight, wq_data, wq_scale = ctx.saved_tensors
        recipe, comm, native = ctx.recipe, ctx.comm, ctx.native
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1])
        rows = _a_rows(recipe, native)  # 1 for the transposable grad recipe, whose dyq the wgrad GEMM reuses
        dyq = (quantize(pad_rows(dy2, rows), recipe.grad, recipe.grad_dtype)
               if need_dx or transposable(recipe.grad) else None)
        dx = handle = None
        if need_dx:
            wq = Quantized(wq_data, wq_scale, recipe.weight) if wq_data is not None else None
            wq_t = _quantize_t(wq, weight, recipe.weight, recipe.fwd_dtype)  # Wᵀ [K, N]
            dx = fp8_mm(dyq, wq_t, dy.dtype, native=native)  # type: ignore[arg-type]
            if dx.shape[0] != dy2.shape[0]:
                dx = dx[: dy2.shape[0]].contiguous()
            dx_local, handle = reduce_dgrad(dx, comm)
        dw = None
        if need_dw:
            if xq_data is not None:
                xq, x2 = Quantized(xq_data, xq_scale, recipe.activation), None
            else:
                total = gather_sequence_parallel(x, comm.tp_group) if comm.sequence_parallel else x
                xq, x2 = None, total.reshape(-1, total.shape[-1])
            dyq_t, xq_t = _wgrad_operands(dy2, dyq if transposable(recipe.grad) else None, x2, xq, recipe,
                                          pad=native)
            dw = fp8_mm(dyq_t, xq_t, weight.dtype, native=native)  # [N, K]
            if comm.gradient_accumulation_fusion and hasattr(weight, "main_grad"):
                weight.main_grad.add_(dw)
                dw = main_grad_placeholder(weight, dy.dtype)
        db = dy2.sum(0) if need_db and ctx.has_bias else None
        if handle is not None:
            handle.wait()
        if dx is not None:
            dx = dx_local.view(*ctx.x_shape)
        return dx, dw, db, None, None, None


def main_grad_placeholder(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """What megatron's fused path hands autograd once ``dW`` is in ``main_grad``: nothing, or (when DDP
    tracks ``grad_added_to_main_grad``) a placeholder its hook skips."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(weight.main_grad.shape, dtype=dtype, device=weight.device)


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: FP8Recipe,
               comm: LinearComm | None = None, *, native: bool = True) -> torch.Tensor:
    """``x·weightᵀ + bias`` with fp8 GEMMs forward and backward (``x``: [..., K], ``weight``: [N, K]).

    ``comm`` carries megatron's tensor-parallel switches (default: none). ``native=False`` emulates every
    GEMM (dequantise + matmul), which is how the CPU tests run it.
    """
    return FP8LinearFunction.apply(x, weight, bias, recipe, comm or LinearComm(), native)
