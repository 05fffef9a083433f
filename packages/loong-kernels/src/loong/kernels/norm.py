"""RMSNorm, with an optional fused residual add, and its plain-PyTorch reference.

``y = x / sqrt(mean(x^2) + eps) * (weight + offset)`` over the last dimension, computed in fp32 and
returned in ``x``'s dtype. With ``residual`` the input is first ``h = x + residual`` (rounded to ``x``'s
dtype, as an eager add would be) and both ``y`` and the new residual stream ``h`` are returned: the
pre-norm transformer's "add the sub-layer output, then normalise for the next one" in one pass.

Triton path: forward is one program per ``BLOCK_M`` rows; backward is persistent (``BWD_PROGRAMS_PER_SM``
programs per SM, each walking a contiguous run of rows) so that the weight gradient is reduced in registers
and only one fp32 partial row per program is written, then summed. For rows of more than 2K the walk is
software-pipelined (``tl.range(num_stages=3)``): forward + backward then run at 89-93% of the H200's copy
bandwidth for 4K-8K rows, and 57% for 2K rows (docs/kernels.md).
"""

from __future__ import annotations

import torch

from loong.kernels._dispatch import (
    Backend,
    cdiv,
    check_float,
    kernel,
    next_pow2,
    num_programs,
    use_triton,
    warps_for,
)

try:
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with torch on Linux
    tl = None

MAX_HIDDEN = 65536  # one row lives in registers; wider rows take the reference
BWD_PROGRAMS_PER_SM = 1  # backward grid; 1 measured fastest of 1, 2, 4, 8 on the H200 (benchmarks/kernels.py tune)
BWD_TILING: tuple[int, int] | None = None  # (num_stages, tile elements) for tuning sweeps; None: _bwd_tiling
BWD_MAX_ROWS = 128  # rows per backward tile at most (narrow rows, e.g. q/k norms over a 128-wide head, batch many)
#: how the backward accumulates the weight gradient: "tile" keeps a [rows, hidden] fp32 sum in registers and
#: reduces it over rows once per program; "row" (the kernel before 2026-12-04) reduced every tile over its rows,
#: a cross-warp reduction per tile. benchmarks/rms_norm_sweep.py times both.
BWD_DW_ACCUMULATE = "tile"
FWD_ELEMS = 4096  # elements per forward program (rows batched up to it); benchmarks/rms_norm_sweep.py sweeps it


@kernel
def _rms_fwd(X, R, Y, H, W, RSTD, n_rows, n_cols, stride_x, stride_r, stride_y, stride_h, eps, offset,
             HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    cmask = cols < n_cols
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(R + r64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = x.to(H.dtype.element_ty)
        tl.store(H + r64 * stride_h + cols[None, :], h, mask=mask)
        # normalise exactly the rounded h that is returned (and that backward reads back)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@kernel
def _rms_bwd(DY, DH, X, W, RSTD, DX, DW, n_rows, n_cols, rows_per_prog, stride_dy, stride_dh, stride_x,
             stride_dx, offset, HAS_DH: tl.constexpr, COMPUTE_DW: tl.constexpr, DW_TILE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    dw_tile = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # DW_TILE: summed over rows after the walk
    start = pid * rows_per_prog
    end = start + rows_per_prog
    # bounds from arguments (the interpreter needs plain ints); num_stages > 1 overlaps the next tile's loads
    for r0 in tl.range(0, rows_per_prog, BLOCK_M, num_stages=NUM_STAGES):
        rows = start + r0 + tl.arange(0, BLOCK_M)
        rmask = (rows < end) & (rows < n_rows)
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        wdy = dy * w[None, :]
        c = tl.sum(xhat * wdy, axis=1) / n_cols
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        if HAS_DH:
            dx += tl.load(DH + r64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if DW_TILE:
                dw_tile += dy * xhat  # rows past the end loaded as 0: they add nothing
            else:
                dw += tl.sum(dy * xhat, axis=0)
    if COMPUTE_DW:
        if DW_TILE:
            dw = tl.sum(dw_tile, axis=0)
        tl.store(DW + pid * n_cols + cols, dw, mask=cmask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``[rows, hidden]`` tensor with unit column stride (a copy only when unavoidable)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _config(n_cols: int, elems: int, max_rows: int = 16) -> tuple[int, int, int]:
    """Rows per tile (at most ``max_rows``) so that a tile holds about ``elems`` elements: short rows are batched
    to keep enough bytes in flight per program (the backward walks its rows one tile after another)."""
    block_n = next_pow2(n_cols)
    block_m = max(1, min(max_rows, elems // block_n))
    return block_m, block_n, warps_for(block_m * block_n)


def _bwd_tiling(n_cols: int) -> tuple[int, int]:
    """(software-pipelining stages, elements per tile) of the backward's row walk.

    Swept on the H200 (forward + backward, 16K rows, bf16; stages 1-3 x 8K/16K-element tiles): rows of 4K
    and 8K go from 78% / 81% of copy bandwidth to 89% / 93% with three stages (the next tile's loads overlap
    the current tile's reductions); 2K rows gain less from stages than from bigger tiles (48% -> 57%).
    """
    if BWD_TILING is not None:
        return BWD_TILING
    return (1, 16384) if n_cols <= 2048 else (3, 8192)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps, offset):
        x2 = _rows(x)
        n_rows, n_cols = x2.shape
        y = torch.empty_like(x2)
        h = torch.empty_like(x2) if residual is not None else None
        r2 = _rows(residual) if residual is not None else None
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_m, block_n, warps = _config(n_cols, FWD_ELEMS)
        if n_rows:
            _rms_fwd[(cdiv(n_rows, block_m),)](
                x2, r2 if r2 is not None else x2, y, h if h is not None else y, weight, rstd, n_rows, n_cols,
                x2.stride(0), r2.stride(0) if r2 is not None else 0, y.stride(0),
                h.stride(0) if h is not None else 0, eps, offset,
                HAS_RES=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(h if h is not None else x2, weight, rstd)
        # an unused output (often the new residual's grad) arrives as None instead of a zero tensor to read
        ctx.set_materialize_grads(False)
        ctx.offset = offset
        ctx.has_res = residual is not None
        ctx.shape = x.shape
        if residual is not None:
            return y.view(x.shape), h.view(x.shape)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dh=None):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = _rows(dy) if dy is not None else torch.zeros_like(x2)
        dh2 = _rows(dh) if dh is not None else None
        dx = torch.empty_like(x2)
        compute_dw = ctx.needs_input_grad[1]
        stages, elems = _bwd_tiling(n_cols)
        block_m, block_n, warps = _config(n_cols, elems, BWD_MAX_ROWS)
        progs = max(1, min(cdiv(n_rows, block_m), BWD_PROGRAMS_PER_SM * num_programs(x2.device)))
        rows_per_prog = cdiv(n_rows, progs)
        dw_part = torch.empty((progs, n_cols) if compute_dw else (1,), dtype=torch.float32, device=x2.device)
        if n_rows:
            _rms_bwd[(progs,)](
                dy2, dh2 if dh2 is not None else dy2, x2, weight, rstd, dx, dw_part, n_rows, n_cols,
                rows_per_prog, dy2.stride(0), dh2.stride(0) if dh2 is not None else 0, x2.stride(0),
                dx.stride(0), ctx.offset, HAS_DH=dh2 is not None, COMPUTE_DW=compute_dw,
                DW_TILE=BWD_DW_ACCUMULATE == "tile", BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=stages, num_warps=warps)
        dw = None
        if compute_dw:
            dw = dw_part.sum(0).to(weight.dtype) if n_rows else torch.zeros_like(weight)
        dx = dx.view(ctx.shape)
        return dx, dw, (dx if ctx.has_res else None), None, None


def _why_not(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> str | None:
    reason = check_float("rms_norm", x, "x") or check_float("rms_norm", weight, "weight")
    if reason:
        return reason
    if x.shape[-1] > MAX_HIDDEN:
        return f"hidden size {x.shape[-1]} is over the kernel's limit of {MAX_HIDDEN}"
    if not weight.is_contiguous():
        return "weight is not contiguous"
    if residual is not None and residual.dtype != x.dtype:
        return f"residual has dtype {residual.dtype} but x has {x.dtype}"
    return None


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       residual: torch.Tensor | None = None, *, offset: float = 0.0
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch RMSNorm with the same signature and numerics contract as :func:`rms_norm`."""
    _check_shapes(x, weight, residual)
    h = x + residual if residual is not None else x
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + offset)
    y = y.to(x.dtype)
    return (y, h) if residual is not None else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
             *, offset: float = 0.0, backend: Backend = "auto") -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension of ``x`` (any leading shape, e.g. megatron's ``[s, b, h]``).

    Args:
        x: activations ``[..., hidden]``, fp32/bf16/fp16; any strides (copied only when the last
            dimension is not contiguous or the leading dimensions cannot be flattened as a view).
        weight: ``[hidden]``, any float dtype; the gradient comes back in its dtype.
        eps: added to the mean square.
        residual: optional ``[..., hidden]`` in ``x``'s dtype. When given, ``h = x + residual`` is
            normalised and ``(y, h)`` is returned; the gradient of both inputs is ``dL/dh`` in total.
        offset: added to the weight (``1.0`` for zero-centred gammas, megatron's
            ``layernorm_zero_centered_gamma`` / Gemma).
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see :mod:`loong.kernels`).

    Returns:
        ``y`` in ``x``'s dtype, or ``(y, h)`` with ``residual``.
    """
    _check_shapes(x, weight, residual)
    if not use_triton(backend, "rms_norm", (x, weight, residual), _why_not(x, weight, residual)):
        return rms_norm_reference(x, weight, eps, residual, offset=offset)
    return _RMSNormFn.apply(x, weight, residual, float(eps), float(offset))
