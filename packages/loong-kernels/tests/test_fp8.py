"""FP8 quantisation: the kernels under the interpreter agree with the references bit for bit."""

from __future__ import annotations

import pytest
import torch

from loong.kernels import (
    FP8_MAX,
    KernelUnsupportedError,
    dequantize,
    dequantize_reference,
    quantize_blockwise,
    quantize_blockwise_reference,
    quantize_rowwise,
    quantize_rowwise_reference,
    quantize_tensorwise,
    quantize_tensorwise_reference,
    transpose_2d,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _x(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a wide dynamic range per row, a zero row (scale from the epsilon) and exact ties are all in here
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    x.view(-1, shape[-1])[0] = 0.0
    return x.to(dtype)


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert a[0].dtype == b[0].dtype and a[0].shape == b[0].shape
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
    assert a[1].dtype == torch.float32 and a[1].shape == b[1].shape
    assert torch.equal(a[1], b[1])


CASES = [  # name, triton fn, reference fn, kwargs, input shape
    ("tensorwise", quantize_tensorwise, quantize_tensorwise_reference, {}, (3, 37, 300)),
    ("rowwise", quantize_rowwise, quantize_rowwise_reference, {}, (37, 300)),
    ("1x128", quantize_blockwise, quantize_blockwise_reference, {}, (2, 19, 300)),
    ("128x128", quantize_blockwise, quantize_blockwise_reference, {"block_shape": (128, 128)}, (200, 300)),
    ("1x100", quantize_blockwise, quantize_blockwise_reference, {"block_shape": (1, 100)}, (7, 250)),
]


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bit_exact_against_reference(interpret, case, fp8_dtype, pow2):
    _, fn, ref, kw, shape = case
    for dtype in (torch.float32, torch.bfloat16):
        x = _x(shape, dtype)
        got = fn(x, fp8_dtype=fp8_dtype, pow2_scale=pow2, backend="triton", **kw)
        _same(got, ref(x, fp8_dtype=fp8_dtype, pow2_scale=pow2, **kw))
        if pow2:
            mant, _ = torch.frexp(got[1])
            assert (mant == 0.5).all()


def test_scale_shapes_and_round_trip(interpret, check):
    x = _x((200, 300))
    q, s = quantize_tensorwise(x, backend="triton")
    assert s.shape == ()
    q, s = quantize_rowwise(x, backend="triton")
    assert s.shape == (200, 1)
    q, s = quantize_blockwise(x, backend="triton")
    assert s.shape == (200, 3)
    q, s = quantize_blockwise(x, (128, 128), backend="triton")
    assert s.shape == (2, 3)
    # every block's amax lands on the fp8 maximum (up to the scale's rounding), and values come back
    y = dequantize(q, s, dtype=torch.float32, backend="triton")
    assert check.rel_err(y, x) < 0.05
    blocks = q.float().abs()[:128, :128].amax()
    assert float(blocks) == FP8_MAX[E4M3]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dequantize_matches_reference(interpret, case):
    name, fn, _, kw, shape = case
    q, s = fn(_x(shape), backend="reference", **kw)
    block = (1, 100) if name == "1x100" else None
    # fp32 output: bit exact. bf16: Triton's interpreter casts to bf16 by truncation, so at most 1 ulp apart
    a = dequantize(q, s, block, dtype=torch.float32, backend="triton")
    assert torch.equal(a, dequantize_reference(q, s, block, dtype=torch.float32))
    b = dequantize(q, s, block, backend="triton")
    r = dequantize_reference(q, s, block)
    assert b.dtype == torch.bfloat16
    torch.testing.assert_close(b.float(), r.float(), rtol=2 ** -7, atol=0)


def test_quantized_values_are_correctly_rounded():
    """Independent of the kernels: saturating, round-to-nearest-even fp8, dequantised within half an ulp."""
    x = _x((64, 256))
    q, s = quantize_rowwise_reference(x)
    scaled = x / s
    assert (q.float().abs() <= 448).all()
    err = (q.float() - scaled.clamp(-448, 448)).abs()
    ulp = torch.ldexp(torch.ones_like(scaled), (torch.frexp(scaled.abs().clamp(min=2 ** -6))[1] - 1 - 3))
    assert (err <= ulp / 2 + 1e-12).all()


def test_bad_inputs(interpret):
    with pytest.raises(ValueError, match="fp8_dtype"):
        quantize_rowwise(torch.randn(4, 8), fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs a 2-D"):
        quantize_blockwise(torch.randn(2, 4, 8), (128, 128))
    with pytest.raises(KernelUnsupportedError, match="float64"):
        quantize_rowwise(torch.randn(4, 8, dtype=torch.float64), backend="triton")
    with pytest.raises(KernelUnsupportedError, match="over the kernel's limit"):
        quantize_rowwise(torch.randn(1, 70000), backend="triton")
    q, s = quantize_rowwise(torch.randn(4, 8, dtype=torch.float64))  # auto: the reference takes it
    assert q.dtype == E4M3
    with pytest.raises(ValueError, match="cannot tell the block"):
        dequantize(q, torch.ones(3, 3))
    with pytest.raises(ValueError, match="must be float8"):
        dequantize(torch.randn(4, 8), s)


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.uint8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (37, 300), (130, 129)])
def test_transpose_2d_is_a_bit_exact_transpose(interpret, dtype, shape):
    """Odd shapes straddle the 128/64 tiles; the bits of every element (fp8 NaN patterns included) survive."""
    bits = torch.randint(0, 256, (shape[0], shape[1] * torch.empty((), dtype=dtype).element_size()),
                         generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    x = bits.view(dtype)
    y = transpose_2d(x, backend="triton")
    assert y.shape == (shape[1], shape[0]) and y.is_contiguous() and y.dtype == dtype
    assert torch.equal(y.view(torch.uint8), x.t().contiguous().view(torch.uint8))


def test_transpose_2d_falls_back_or_refuses(interpret):
    x = torch.arange(12, dtype=torch.float64).view(3, 4)
    assert torch.equal(transpose_2d(x), x.t())  # auto on CPU: the reference
    with pytest.raises(KernelUnsupportedError, match="8-byte"):
        transpose_2d(x, backend="triton")
    with pytest.raises(KernelUnsupportedError, match="not row-major"):
        transpose_2d(x.float().t(), backend="triton")
    with pytest.raises(ValueError, match="2-D"):
        transpose_2d(x.view(-1))
