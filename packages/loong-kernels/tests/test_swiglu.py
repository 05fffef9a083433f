"""SwiGLU on the fused gate-up tensor: interpreter kernel against the reference, fp64 and megatron's GLU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loong.kernels import KernelUnsupportedError, swiglu, swiglu_reference


def _grads(fn, gu, seed=1):
    y = fn(gu)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    (g,) = torch.autograd.grad((y.float() * probe).sum(), gu)
    return y, g


@pytest.mark.parametrize("shape", [(7, 2 * 99), (3, 5, 2 * 2100), (1, 2)])
def test_fp32_matches_reference(interpret, check, shape):
    gu = torch.randn(shape, generator=torch.Generator().manual_seed(0), requires_grad=True)
    yk, gk = _grads(lambda t: swiglu(t, backend="triton"), gu)
    yr, gr = _grads(swiglu_reference, gu)
    assert yk.shape == (*shape[:-1], shape[-1] // 2)
    assert check.rel_err(yk, yr) < 1e-6 and check.rel_err(gk, gr) < 1e-6


def test_bf16_no_worse_than_reference(interpret, check):
    gu = (2 * torch.randn(13, 2 * 300, generator=torch.Generator().manual_seed(0))).bfloat16().requires_grad_()
    yk, gk = _grads(lambda t: swiglu(t, backend="triton"), gu)
    yr, gr = _grads(swiglu_reference, gu)
    gu64 = gu.detach().double().requires_grad_()
    ye, ge = _grads(swiglu_reference, gu64)
    assert yk.dtype == gk.dtype == torch.bfloat16
    check.no_worse(yk, yr, ye)
    check.no_worse(gk, gr, ge)


def test_order_is_megatrons_gate_first(interpret, check):
    """megatron-core's glu: ``x = torch.chunk(x, 2, dim=-1); silu(x[0]) * x[1]``."""
    gu = torch.randn(4, 6, 2 * 33)
    x = torch.chunk(gu, 2, dim=-1)
    assert check.rel_err(swiglu(gu, backend="triton"), F.silu(x[0]) * x[1]) < 1e-6
    assert check.rel_err(swiglu(gu, backend="triton"), F.silu(x[1]) * x[0]) > 1e-2


def test_finite_differences(interpret, check):
    gu = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(2), requires_grad=True)
    probe = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    analytic, numeric = check.directional_fd(lambda t: (swiglu(t, backend="triton") * probe).sum(), [gu])
    assert analytic == pytest.approx(numeric, rel=2e-3)


def test_strided_input(interpret, check):
    """A view whose rows are further apart than 2*ffn (e.g. a slice of a wider projection) needs no copy."""
    wide = torch.randn(9, 100)
    gu = wide[:, :64]
    assert not gu.is_contiguous()
    assert check.rel_err(swiglu(gu, backend="triton"), swiglu_reference(gu)) < 1e-6


def test_unsupported_inputs(interpret):
    with pytest.raises(ValueError, match="must be even"):
        swiglu(torch.randn(3, 7))
    with pytest.raises(KernelUnsupportedError, match="float64"):
        swiglu(torch.randn(3, 8, dtype=torch.float64), backend="triton")
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(swiglu(x), swiglu_reference(x))
