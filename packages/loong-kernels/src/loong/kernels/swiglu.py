"""SwiGLU on the fused gate-up projection, and its plain-PyTorch reference.

megatron-core's MLP with ``gated_linear_unit=True`` runs one fc1 GEMM whose output is ``[..., 2 * ffn]``
and then ``glu(x) = act(chunk(x, 2)[0]) * chunk(x, 2)[1]``: the *first* half is the gate (passed to
SiLU), the second the linear "up" part. This kernel reads that tensor as is, so the split, the two
halves' copies and the activation's intermediates never reach memory: forward reads ``2F`` and writes
``F`` per row, backward reads ``F + 2F`` and writes ``2F``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loong.kernels._dispatch import Backend, cdiv, check_float, kernel, next_pow2, use_triton

try:
    import triton.language as tl
except ImportError:  # pragma: no cover
    tl = None


@kernel
def _swiglu_fwd(GU, Y, n_cols, stride_gu, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@kernel
def _swiglu_bwd(DY, GU, DGU, n_cols, stride_dy, stride_gu, stride_dgu, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    # d silu(g)/dg = s + g * s * (1 - s)
    dg = dy * u * (s + silu * (1.0 - s))
    du = dy * silu
    tl.store(DGU + row * stride_dgu + cols, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + row * stride_dgu + n_cols + cols, du.to(DGU.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _launch_cfg(ffn: int) -> tuple[int, int]:
    block = min(next_pow2(ffn), 2048)
    return block, (8 if block >= 2048 else 4)


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        gu = _rows(gate_up)
        n_rows, ffn = gu.shape[0], gu.shape[1] // 2
        y = torch.empty((n_rows, ffn), dtype=gu.dtype, device=gu.device)
        block, warps = _launch_cfg(ffn)
        if n_rows and ffn:
            _swiglu_fwd[(n_rows, cdiv(ffn, block))](gu, y, ffn, gu.stride(0), y.stride(0),
                                                     BLOCK=block, num_warps=warps)
        ctx.save_for_backward(gu)
        ctx.shape = gate_up.shape
        return y.view(*gate_up.shape[:-1], ffn)

    @staticmethod
    def backward(ctx, dy):
        (gu,) = ctx.saved_tensors
        dy2 = _rows(dy)
        n_rows, ffn = gu.shape[0], gu.shape[1] // 2
        dgu = torch.empty_like(gu)
        block, warps = _launch_cfg(ffn)
        if n_rows and ffn:
            _swiglu_bwd[(n_rows, cdiv(ffn, block))](dy2, gu, dgu, ffn, dy2.stride(0), gu.stride(0),
                                                     dgu.stride(0), BLOCK=block, num_warps=warps)
        return dgu.view(ctx.shape)


def _check(gate_up: torch.Tensor) -> None:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension of gate_up must be even (gate then up), got shape "
                         f"{tuple(gate_up.shape)}")


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch SwiGLU: ``silu(gate) * up`` in fp32, returned in the input dtype."""
    _check(gate_up)
    gate, up = torch.chunk(gate_up, 2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


def swiglu(gate_up: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [..., 2 * ffn]`` holding the gate first, then up.

    This is megatron-core's GLU order (``torch.chunk(x, 2, dim=-1)``; ``x[0]`` is activated). With
    tensor parallelism each rank's fc1 shard is already ``[gate_shard, up_shard]``, so the op is local.

    Args:
        gate_up: fc1 output ``[..., 2 * ffn]``, fp32/bf16/fp16; the last dimension should be contiguous
            (otherwise it is copied first).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Returns:
        ``[..., ffn]`` in the input dtype (computed in fp32).
    """
    _check(gate_up)
    if not use_triton(backend, "swiglu", (gate_up,), check_float("swiglu", gate_up, "gate_up")):
        return swiglu_reference(gate_up)
    return _SwiGLUFn.apply(gate_up)
