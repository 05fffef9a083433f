"""FP8 quantisation and dequantisation (e4m3 / e5m2 values, fp32 scales) for the FP8 training recipes.

Every granularity is "one scale per block of ``bm x bk`` elements" of a 2-D ``[M, K]`` view:

======================  =================  ======================================  ====================
function                block              scale shape                             typical use
======================  =================  ======================================  ====================
quantize_tensorwise     the whole tensor   ``[]`` (0-dim)                          per-tensor recipes
quantize_rowwise        ``1 x K``          ``[..., 1]``                            rowwise recipes
quantize_blockwise      ``1 x 128``        ``[..., ceil(K/128)]``                  DeepSeek-V3 activations
quantize_blockwise      ``128 x 128``      ``[ceil(M/128), ceil(K/128)]``          DeepSeek-V3 weights
======================  =================  ======================================  ====================

``scale`` is the *dequantisation* factor, ``x ≈ q.float() * scale`` (the convention of
``torch._scaled_mm``'s ``scale_a``/``scale_b``): ``scale = max(amax, 1e-12) / fp8_max``, optionally
rounded up to a power of two (``pow2_scale``, as UE8M0 recipes want), and
``q = saturate(x / scale)`` rounded to nearest even. The Triton kernels and the references agree bit
for bit: both divide with IEEE rounding and round once to fp8.

Non-finite inputs are not supported (a NaN makes its block's scale NaN, as in the references).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loong.kernels._dispatch import (
    Backend,
    cdiv,
    check_float,
    kernel,
    next_pow2,
    use_triton,
)

try:
    import triton.language as tl
except ImportError:  # pragma: no cover
    tl = None

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_FORMAT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}  # mantissa bits, min normal exponent
AMAX_EPS = 1e-12
MAX_ROW = 65536  # rowwise keeps a whole row in registers
_GLOBAL, _PER_ROW, _PER_TILE = 0, 1, 2


@kernel
def _amax_kernel(X, AMAX, n_rows, n_cols, stride_xm, TILE_M: tl.constexpr, TILE_K: tl.constexpr):
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    cols = tl.program_id(1) * TILE_K + tl.arange(0, TILE_K)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    tl.atomic_max(AMAX, tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0))


@kernel
def _quant_kernel(X, Q, S, AMAX, n_rows, n_cols, block_m, block_k, stride_xm, stride_qm, stride_sm, stride_sk,
                  fp8_max, MODE: tl.constexpr, POW2: tl.constexpr, MANT: tl.constexpr,
                  MIN_EXP: tl.constexpr, TILE_M: tl.constexpr, TILE_K: tl.constexpr):
    # one program per (block_m x block_k) block; TILE_* are those rounded up to powers of two
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    rows = pm * block_m + tl.arange(0, TILE_M)
    cols = pk * block_k + tl.arange(0, TILE_K)
    rmask = (tl.arange(0, TILE_M) < block_m) & (rows < n_rows)
    mask = rmask[:, None] & ((tl.arange(0, TILE_K) < block_k) & (cols < n_cols))[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if MODE == 0:
        amax = tl.load(AMAX)
    elif MODE == 1:
        amax = tl.max(tl.abs(x), axis=1)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    # IEEE division (div_rn), as torch divides: the default fp32 '/' is approximate and would flip
    # the fp8 rounding of values that land near a tie
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), fp8_max)
    if POW2:  # round up to a power of two exactly, on the bits (log2/exp2 are approximate)
        bits = scale.to(tl.int32, bitcast=True)
        e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (e << 23).to(tl.float32, bitcast=True)
    if MODE == 1:
        y = tl.math.div_rn(x, scale[:, None])
    else:
        y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -fp8_max), fp8_max)
    # Round to the fp8 grid here, in fp32 and exactly (round half to even), so that the cast below only
    # re-encodes a representable value: the result then does not depend on how a backend converts (Triton's
    # interpreter rounds fp32 -> fp8 wrongly when the mantissa carries into the exponent, measured).
    a = tl.abs(y)
    eb = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 + MIN_EXP)
    ulp = ((eb - MANT) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((254 - eb + MANT) << 23).to(tl.float32, bitcast=True)
    a = ((a * inv_ulp + 8388608.0) - 8388608.0) * ulp  # a * inv_ulp < 2^4: adding 2^23 rounds it to an integer
    y = a * tl.where(y.to(tl.int32, bitcast=True) < 0, -1.0, 1.0)  # keeps the sign of -0.0
    tl.store(Q + r64 * stride_qm + cols[None, :], y.to(Q.dtype.element_ty), mask=mask)
    if MODE == 0:
        if (pm == 0) & (pk == 0):
            tl.store(S, scale)
    elif MODE == 1:
        tl.store(S + rows * stride_sm + pk * stride_sk, scale, mask=rmask)
    else:
        tl.store(S + pm * stride_sm + pk * stride_sk, scale)


@kernel
def _dequant_kernel(Q, S, Y, n_rows, n_cols, stride_qm, stride_ym, stride_sm, stride_sk, BM: tl.constexpr,
                    BK: tl.constexpr, TILE_M: tl.constexpr, TILE_K: tl.constexpr):
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    cols = tl.program_id(1) * TILE_K + tl.arange(0, TILE_K)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    q = tl.load(Q + r64 * stride_qm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sidx = (rows // BM).to(tl.int64)[:, None] * stride_sm + (cols // BK)[None, :] * stride_sk
    s = tl.load(S + sidx, mask=mask, other=1.0)
    tl.store(Y + r64 * stride_ym + cols[None, :], (q * s).to(Y.dtype.element_ty), mask=mask)


@kernel
def _transpose_kernel(X, Y, n_rows, n_cols, stride_xm, stride_ym, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :],
                mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :])
    # the tile goes through shared memory (tl.trans), so both the load and the store are coalesced
    tl.store(Y + cols.to(tl.int64)[:, None] * stride_ym + rows[None, :], tl.trans(x),
             mask=(cols < n_cols)[:, None] & (rows < n_rows)[None, :])


# ---------------------------------------------------------------------------------------------- helpers


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        x = x.reshape(1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    mant, exp = torch.frexp(s)  # s = mant * 2**exp, mant in [0.5, 1)
    return torch.where(mant == 0.5, s, torch.ldexp(torch.ones_like(s), exp))


def _check_fmt(fp8_dtype: torch.dtype) -> None:
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")


def _quant_reference(x2: torch.Tensor, bm: int, bk: int, fp8_dtype: torch.dtype, pow2: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D tensor with one scale per ``bm x bk`` block; returns ``(q, scale[nm, nk])``."""
    fmax = FP8_MAX[fp8_dtype]
    m, k = x2.shape
    nm, nk = cdiv(m, bm), cdiv(k, bk)
    blocks = F.pad(x2.float(), (0, nk * bk - k, 0, nm * bm - m)).view(nm, bm, nk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_EPS)
    # a tensor divisor: CUDA torch divides by a Python scalar as a multiplication by its reciprocal, which
    # is not the correctly rounded quotient the kernel (and CPU torch) compute
    scale = amax / torch.full_like(amax, fmax)
    if pow2:
        scale = _pow2_ceil(scale)
    q = (blocks / scale[:, None, :, None]).clamp(-fmax, fmax).view(nm * bm, nk * bk)[:m, :k].to(fp8_dtype)
    return q, scale


def _quant_triton(x2: torch.Tensor, mode: int, bm: int, bk: int, fp8_dtype: torch.dtype, pow2: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x2.shape
    q = torch.empty((m, k), dtype=fp8_dtype, device=x2.device)
    amax = torch.zeros(1, dtype=torch.float32, device=x2.device)
    if mode == _GLOBAL:
        scale = torch.empty((1, 1), dtype=torch.float32, device=x2.device)
        tile_k = min(next_pow2(k), 1024)
        tile_m = max(1, 4096 // tile_k)
        grid = (cdiv(m, tile_m), cdiv(k, tile_k))
        if m * k:
            _amax_kernel[grid](x2, amax, m, k, x2.stride(0), TILE_M=tile_m, TILE_K=tile_k, num_warps=4)
    elif mode == _PER_ROW:
        scale = torch.empty((m, cdiv(k, bk)), dtype=torch.float32, device=x2.device)
        tile_k = next_pow2(bk)
        tile_m = bm = max(1, min(64, 4096 // tile_k))  # independent rows per program
        grid = (cdiv(m, tile_m), cdiv(k, bk))
    else:
        scale = torch.empty((cdiv(m, bm), cdiv(k, bk)), dtype=torch.float32, device=x2.device)
        tile_m, tile_k = next_pow2(bm), next_pow2(bk)
        grid = (cdiv(m, bm), cdiv(k, bk))
    mant, min_exp = _FORMAT[fp8_dtype]
    if m * k:
        _quant_kernel[grid](x2, q, scale, amax, m, k, tile_m if mode == _GLOBAL else bm,
                            tile_k if mode == _GLOBAL else bk, x2.stride(0), q.stride(0), scale.stride(0),
                            scale.stride(1),
                            FP8_MAX[fp8_dtype], MODE=mode, POW2=pow2, MANT=mant,
                            MIN_EXP=min_exp, TILE_M=tile_m, TILE_K=tile_k,
                            num_warps=8 if tile_m * tile_k >= 8192 else 4)
    return q, scale


def _quantize(name: str, x: torch.Tensor, mode: int, bm: int, bk: int, fp8_dtype: torch.dtype, pow2: bool,
              backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x``'s 2-D view; ``bm``/``bk`` are ignored for tensorwise (the block is the whole view)."""
    _check_fmt(fp8_dtype)
    why = check_float(name, x, "x")
    if why is None and mode == _PER_ROW and bk > MAX_ROW:
        why = f"rows of {bk} elements are over the kernel's limit of {MAX_ROW}"
    if why is None and mode != _GLOBAL and bm * bk > 65536:
        why = f"block {bm}x{bk} is over the kernel's limit of 65536 elements"
    x2 = _rows(x)
    if use_triton(backend, name, (x,), why):
        return _quant_triton(x2, mode, bm, bk, fp8_dtype, pow2)
    if mode == _GLOBAL:
        bm, bk = x2.shape
    return _quant_reference(x2, max(bm, 1), max(bk, 1), fp8_dtype, pow2)


# ------------------------------------------------------------------------------------------------ public


def quantize_tensorwise(x: torch.Tensor, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2_scale: bool = False,
                        backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor. Returns ``(q, scale)``: ``q`` with ``x``'s shape, ``scale`` 0-dim fp32."""
    q, s = _quantize("quantize_tensorwise", x, _GLOBAL, 0, 0, fp8_dtype, pow2_scale, backend)
    return q.view(x.shape), s.reshape(())


def quantize_rowwise(x: torch.Tensor, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2_scale: bool = False,
                     backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (last dimension). Returns ``q`` with ``x``'s shape and ``scale`` ``[..., 1]``."""
    if x.dim() == 0:
        raise ValueError("quantize_rowwise: x must have at least one dimension")
    q, s = _quantize("quantize_rowwise", x, _PER_ROW, 1, x.shape[-1], fp8_dtype, pow2_scale, backend)
    return q.view(x.shape), s.view(*x.shape[:-1], 1)


def quantize_blockwise(x: torch.Tensor, block_shape: tuple[int, int] = (1, 128), *,
                       fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2_scale: bool = False,
                       backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per ``block_shape`` block (DeepSeek-V3 style).

    ``(1, bk)`` (activations, default ``1 x 128``): ``x`` is ``[..., K]``, ``scale`` is
    ``[..., ceil(K / bk)]``. ``(bm, bk)`` with ``bm > 1`` (weights, ``128 x 128``): ``x`` must be 2-D
    ``[M, K]`` and ``scale`` is ``[ceil(M / bm), ceil(K / bk)]``. Partial edge blocks take the amax of the
    elements they hold.
    """
    bm, bk = (int(b) for b in block_shape)
    if bm < 1 or bk < 1:
        raise ValueError(f"quantize_blockwise: block_shape must be positive, got {block_shape}")
    if x.dim() == 0 or (bm > 1 and x.dim() != 2):
        raise ValueError(f"quantize_blockwise: block {bm}x{bk} needs a 2-D tensor (1xK blocks take [..., K]), got "
                         f"shape {tuple(x.shape)}")
    mode = _PER_ROW if bm == 1 else _PER_TILE
    q, s = _quantize("quantize_blockwise", x, mode, bm, bk, fp8_dtype, pow2_scale, backend)
    if bm == 1:
        return q.view(x.shape), s.view(*x.shape[:-1], s.shape[-1])
    return q, s


def transpose_2d(x: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """``x.t().contiguous()`` for a 2-D tensor of 1, 2 or 4-byte elements (fp8 included), as a tiled copy.

    Why: the FP8 GEMMs need the quantised activations and gradients transposed for the weight-gradient
    GEMM (cuBLAS runs fp8 only as "TN"), and PyTorch's generic strided copy moves one-byte elements at a
    small fraction of the memory bandwidth (measured on the H200: the transposes cost more than the fp8
    GEMMs saved). The Triton kernel moves whole tiles through shared memory; elements are copied as raw
    bits, so the result is exact for every dtype.
    """
    if x.dim() != 2:
        raise ValueError(f"transpose_2d: expected a 2-D tensor, got shape {tuple(x.shape)}")
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(x.element_size())
    why = None if bits is not None else f"{x.element_size()}-byte elements are not supported"
    if why is None and x.stride(1) != 1:
        why = "x is not row-major (its transpose is: call .t() instead)"
    if not use_triton(backend, "transpose_2d", (x,), why) or x.numel() == 0:
        return x.t().contiguous()
    m, n = x.shape
    y = torch.empty((n, m), dtype=x.dtype, device=x.device)
    tile = 128 if x.element_size() == 1 else 64
    _transpose_kernel[(cdiv(m, tile), cdiv(n, tile))](x.view(bits), y.view(bits), m, n, x.stride(0), y.stride(0),
                                                      BM=tile, BN=tile, num_warps=8 if tile == 128 else 4)
    return y


def _infer_block(q: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int] | None) -> tuple[int, int]:
    """The ``(bm, bk)`` block of ``q``'s 2-D view that each scale covers (``(0, 0)`` = tensorwise)."""
    k = q.shape[-1] if q.dim() else 1
    if scale.numel() == 1 and block_shape is None:
        return 0, 0
    if block_shape is not None:
        return int(block_shape[0]), int(block_shape[1])
    lead = tuple(q.shape[:-1])
    if tuple(scale.shape) == lead + (1,):
        return 1, k
    if tuple(scale.shape) == lead + (cdiv(k, 128),):
        return 1, 128
    if q.dim() == 2 and tuple(scale.shape) == (cdiv(q.shape[0], 128), cdiv(k, 128)):
        return 128, 128
    raise ValueError(f"dequantize: cannot tell the block of scale {tuple(scale.shape)} for q {tuple(q.shape)}; "
                     "pass block_shape")


def dequantize(q: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int] | None = None, *,
               dtype: torch.dtype = torch.bfloat16, backend: Backend = "auto") -> torch.Tensor:
    """``q.float() * scale`` broadcast over its blocks, in ``dtype``.

    The block is inferred from the shapes the ``quantize_*`` functions return (0-dim/one-element scale:
    tensorwise; ``[..., 1]``: rowwise; ``[..., ceil(K/128)]``: 1x128; ``[ceil(M/128), ceil(K/128)]``:
    128x128); pass ``block_shape`` for other block sizes. Where two readings fit the same shapes they mean
    the same thing.
    """
    if q.dtype not in FP8_MAX:
        raise ValueError(f"dequantize: q must be float8_e4m3fn or float8_e5m2, got {q.dtype}")
    bm, bk = _infer_block(q, scale, block_shape)
    q2 = _rows(q)
    m, k = q2.shape
    if bm == 0:
        s2 = scale.reshape(1, 1).float()
    else:
        s2 = scale.reshape(-1, scale.shape[-1]).float()
        if bm > 1 and q.dim() != 2:
            raise ValueError(f"dequantize: block {bm}x{bk} needs a 2-D q, got {tuple(q.shape)}")
        if s2.shape != (cdiv(m, bm), cdiv(k, bk)):
            raise ValueError(f"dequantize: scale {tuple(scale.shape)} does not fit q {tuple(q.shape)} in {bm}x{bk} "
                             "blocks")
    why = check_float("dequantize", torch.empty(0, dtype=dtype), "dtype")
    if use_triton(backend, "dequantize", (q, scale), why):
        y = torch.empty((m, k), dtype=dtype, device=q.device)
        if bm == 0 or (bm == 1 and bk == k):  # tensorwise or rowwise: no division by the block needed
            bm_c, bk_c, ssm, ssk = 1, 1, (0 if bm == 0 else s2.stride(0)), 0
        else:
            # block sizes are compile-time constants: division by them is a multiply and a shift
            bm_c, bk_c, ssm, ssk = bm, bk, s2.stride(0), s2.stride(1)
        tile_k = min(next_pow2(k), 1024)
        tile_m = max(1, 4096 // tile_k)
        if m * k:
            _dequant_kernel[(cdiv(m, tile_m), cdiv(k, tile_k))](
                q2, s2, y, m, k, q2.stride(0), y.stride(0), ssm, ssk, BM=bm_c, BK=bk_c, TILE_M=tile_m,
                TILE_K=tile_k, num_warps=4)
        return y.view(q.shape)
    if bm == 0:
        bm, bk = max(m, 1), max(k, 1)
    return _dequant_reference(q2, s2, bm, bk, dtype).view(q.shape)


def _dequant_reference(q2: torch.Tensor, s2: torch.Tensor, bm: int, bk: int, dtype: torch.dtype) -> torch.Tensor:
    m, k = q2.shape
    full = s2.repeat_interleave(bm, 0)[:m].repeat_interleave(bk, 1)[:, :k]
    return (q2.float() * full).to(dtype)

def quantize_tensorwise_reference(x: torch.Tensor, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                                  pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch twin of :func:`quantize_tensorwise`."""
    return quantize_tensorwise(x, fp8_dtype=fp8_dtype, pow2_scale=pow2_scale, backend="reference")


def quantize_rowwise_reference(x: torch.Tensor, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                               pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch twin of :func:`quantize_rowwise`."""
    return quantize_rowwise(x, fp8_dtype=fp8_dtype, pow2_scale=pow2_scale, backend="reference")


def quantize_blockwise_reference(x: torch.Tensor, block_shape: tuple[int, int] = (1, 128), *,
                                 fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2_scale: bool = False
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch twin of :func:`quantize_blockwise`."""
    return quantize_blockwise(x, block_shape, fp8_dtype=fp8_dtype, pow2_scale=pow2_scale, backend="reference")


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int] | None = None, *,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Plain-PyTorch twin of :func:`dequantize`."""
    return dequantize(q, scale, block_shape, dtype=dtype, backend="reference")
