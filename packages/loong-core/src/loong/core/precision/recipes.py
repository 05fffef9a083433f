"""FP8 recipes: which granularity and format each operand of a linear layer's three GEMMs takes.

A linear layer ``Y = X·Wᵀ`` runs three GEMMs per training step. Each is written here as ``A·Bᵀ`` with
both operands stored *contraction-last* (row-major ``[rows, K]``), which is the layout
``torch._scaled_mm`` wants for ``A`` and, transposed, for ``B``:

=========  ===========================  ==================  ===================
GEMM       A (rows x contraction)       B (rows x contr.)   result
=========  ===========================  ==================  ===================
forward    X   ``[M, K]``               W   ``[N, K]``      Y  ``[M, N]``
dgrad      dY  ``[M, N]``               Wᵀ  ``[K, N]``      dX ``[M, K]``
wgrad      dYᵀ ``[N, M]``               Xᵀ  ``[K, M]``      dW ``[N, K]``
=========  ===========================  ==================  ===================

Every scale block lies along the contraction dimension, so a granularity that is symmetric under
transposition (one scale for the whole tensor, or 128x128 tiles) quantises ``W`` once for both the
forward and dgrad GEMMs (``Wq.t()`` *is* the quantised ``Wᵀ``); rowwise and 1x128 scales are not, so the
transposed operand is quantised again from the high-precision tensor (as torchao's rowwise recipe and
DeepSeek-V3's 128x1 backward activations do).

The three recipes:

- ``tensorwise``: one scale per tensor; e4m3 forward, e5m2 gradients (Transformer Engine's HYBRID
  format: gradients need range more than precision).
- ``rowwise``: one scale per row of every operand; e4m3 everywhere (torchao's rowwise recipe: a scale
  per row already gives gradients their range).
- ``blockwise``: DeepSeek-V3: activations and gradients in 1x128 blocks, weights in 128x128 tiles,
  e4m3 everywhere.

Scales follow loong-kernels' convention (the dequantisation factor, ``x ≈ q.float() * scale``), which
is ``torch._scaled_mm``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from loong.kernels import dequantize, quantize_blockwise, quantize_rowwise, quantize_tensorwise, transpose_2d

Granularity = Literal["tensor", "row", "1x128", "128x128"]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_BLOCK: dict[str, tuple[int, int] | None] = {"tensor": None, "row": None, "1x128": (1, 128),
                                             "128x128": (128, 128)}


@dataclass(frozen=True)
class FP8Recipe:
    """How a linear layer's operands are quantised.

    Attributes:
        name: ``tensorwise``, ``rowwise`` or ``blockwise``.
        activation: granularity of ``X`` (and of ``Xᵀ`` in the weight-gradient GEMM).
        weight: granularity of ``W`` (and of ``Wᵀ`` in the input-gradient GEMM).
        grad: granularity of the output gradient ``dY`` (and ``dYᵀ``).
        grad_dtype: fp8 format of ``dY``; ``X`` and ``W`` are always e4m3.
        fast_accum_forward: let the forward GEMM use Hopper's fast (reduced-precision) accumulation, as
            torchao does; the two gradient GEMMs never do.
    """

    name: str
    activation: Granularity
    weight: Granularity
    grad: Granularity
    grad_dtype: torch.dtype = E4M3
    fast_accum_forward: bool = True

    @property
    def fwd_dtype(self) -> torch.dtype:
        """The fp8 format of activations and weights."""
        return E4M3


TENSORWISE = FP8Recipe("tensorwise", "tensor", "tensor", "tensor", grad_dtype=E5M2)
ROWWISE = FP8Recipe("rowwise", "row", "row", "row")
BLOCKWISE = FP8Recipe("blockwise", "1x128", "128x128", "1x128")
RECIPES: dict[str, FP8Recipe] = {r.name: r for r in (TENSORWISE, ROWWISE, BLOCKWISE)}
#: values of ``precision.fp8``; ``adaptive`` runs ``precision.fp8_adaptive_recipe`` where it pays
FP8_MODES = ("off", "tensorwise", "rowwise", "blockwise", "adaptive")


def transposable(granularity: Granularity) -> bool:
    """Whether quantising ``t`` and transposing equals quantising ``tᵀ`` (bit for bit)."""
    return granularity in ("tensor", "128x128")


@dataclass
class Quantized:
    """An fp8 matrix ``data`` [R, C] (row-major, C the contraction dimension) and its fp32 scales.

    ``scale`` shapes: ``[]`` (tensor), ``[R, 1]`` (row), ``[R, ceil(C/128)]`` (1x128),
    ``[ceil(R/128), ceil(C/128)]`` (128x128).
    """

    data: torch.Tensor
    scale: torch.Tensor
    granularity: Granularity

    def t(self) -> Quantized:
        """The quantised transpose, without requantising (only for transposable granularities)."""
        if not transposable(self.granularity):
            raise ValueError(f"a {self.granularity} quantisation is not the quantisation of the transpose")
        scale = self.scale if self.granularity == "tensor" else self.scale.t().contiguous()
        return Quantized(transpose_2d(self.data), scale, self.granularity)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale`` broadcast over the blocks, in ``dtype``."""
        block = _BLOCK[self.granularity]
        if self.granularity == "row":
            block = (1, self.data.shape[1])
        return dequantize(self.data, self.scale, block, dtype=dtype)


def quantize(t: torch.Tensor, granularity: Granularity, fp8_dtype: torch.dtype = E4M3) -> Quantized:
    """Quantise a 2-D tensor along its last (contraction) dimension.

    Runs loong-kernels' Triton kernels on CUDA and their PyTorch references elsewhere; both give the same
    bits. A transposed view is copied first (by loong-kernels' tiled ``transpose_2d``).
    """
    if t.dim() != 2:
        raise ValueError(f"quantize: expected a 2-D tensor, got shape {tuple(t.shape)}")
    if t.stride(1) != 1 and t.stride(0) == 1:  # a transposed view: a tiled copy, not torch's strided one
        t = transpose_2d(t.t())
    if granularity == "tensor":
        q, s = quantize_tensorwise(t, fp8_dtype=fp8_dtype)
    elif granularity == "row":
        q, s = quantize_rowwise(t, fp8_dtype=fp8_dtype)
    elif granularity in ("1x128", "128x128"):
        q, s = quantize_blockwise(t, _BLOCK[granularity], fp8_dtype=fp8_dtype)  # type: ignore[arg-type]
    else:
        raise ValueError(f"quantize: unknown granularity {granularity!r}")
    return Quantized(q, s.float(), granularity)
