"""RMSNorm (+ fused residual add): the Triton kernel under the interpreter against the reference and fp64."""

from __future__ import annotations

import pytest
import torch

import loong.kernels.norm as norm
from loong.kernels import KernelUnsupportedError, rms_norm, rms_norm_reference

# rows and widths that are not multiples of the blocks; (300, 16): narrow rows, many to a backward tile
SHAPES = [(37, 300), (3, 5, 129), (5, 2), (300, 16)]


def _inputs(shape, dtype, wdtype=None, residual=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(wdtype or dtype).requires_grad_()
    r = torch.randn(shape, generator=g).to(dtype).requires_grad_() if residual else None
    return x, w, r


def _run(fn, x, w, r, offset=0.0, seed=1):
    """Forward and the grads of a random linear functional of all outputs."""
    out = fn(x, w, 1e-5, r, offset=offset)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
    leaves = [t for t in (x, w, r) if t is not None]
    return outs, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dw", ["tile", "row"])
def test_fp32_matches_reference(interpret, check, shape, residual, dw, monkeypatch):
    """Both ways the backward accumulates the weight gradient (norm.BWD_DW_ACCUMULATE)."""
    monkeypatch.setattr(norm, "BWD_DW_ACCUMULATE", dw)
    x, w, r = _inputs(shape, torch.float32, residual=residual)
    outs_k, grads_k = _run(lambda *a, **k: rms_norm(*a, **k, backend="triton"), x, w, r, offset=0.5)
    outs_r, grads_r = _run(rms_norm_reference, x, w, r, offset=0.5)
    for a, b in zip(outs_k + grads_k, outs_r + grads_r, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert check.rel_err(a, b) < 1e-5


@pytest.mark.parametrize("residual", [False, True])
def test_bf16_no_worse_than_reference(interpret, check, residual):
    x, w, r = _inputs((37, 300), torch.bfloat16, residual=residual)
    outs_k, grads_k = _run(lambda *a, **k: rms_norm(*a, **k, backend="triton"), x, w, r)
    outs_r, grads_r = _run(rms_norm_reference, x, w, r)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    r64 = r.detach().double().requires_grad_() if r is not None else None
    outs_e, grads_e = _run(rms_norm_reference, x64, w64, r64)
    for k, ref, ex in zip(outs_k + grads_k, outs_r + grads_r, outs_e + grads_e, strict=True):
        assert k.dtype == torch.bfloat16
        check.no_worse(k, ref, ex)


def test_weight_in_fp32_with_bf16_activations(interpret, check):
    x, w, _ = _inputs((9, 70), torch.bfloat16, wdtype=torch.float32)
    y = rms_norm(x, w, backend="triton")
    assert y.dtype == torch.bfloat16
    (gw,) = torch.autograd.grad(y.float().sum(), w)
    assert gw.dtype == torch.float32
    (gw_ref,) = torch.autograd.grad(rms_norm_reference(x, w).float().sum(), w)
    assert check.rel_err(gw, gw_ref) < 1e-2


def test_finite_differences(interpret, check):
    x, w, r = _inputs((11, 50), torch.float32, residual=True)
    probe = torch.randn(11, 50, generator=torch.Generator().manual_seed(3))

    def f(x, w, r):
        y, h = rms_norm(x, w, 1e-5, r, backend="triton")
        return (y * probe).sum() + (h * probe.flip(0)).sum()

    analytic, numeric = check.directional_fd(f, [x, w, r])
    assert analytic == pytest.approx(numeric, rel=2e-3)


def test_residual_grads_are_separate_tensors(interpret):
    """x and residual get the same gradient; as leaves they must not share storage (accumulation)."""
    x, w, r = _inputs((5, 40), torch.float32, residual=True)
    for _ in range(2):
        y, h = rms_norm(x, w, 1e-5, r, backend="triton")
        (y.sum() + h.sum()).backward()
    assert torch.equal(x.grad, r.grad)
    assert x.grad.data_ptr() != r.grad.data_ptr()


def test_unused_residual_output_and_non_contiguous_input(interpret, check):
    base, w, r = _inputs((20, 24), torch.float32, residual=True)
    x = base.detach().t().contiguous().t().requires_grad_()  # column-major: the kernel copies it
    assert not x.is_contiguous()
    y, _ = rms_norm(x, w, 1e-5, r, backend="triton")  # grad of h never arrives
    gx, gr = torch.autograd.grad(y.sum(), (x, r))
    y2, _ = rms_norm_reference(x, w, 1e-5, r)
    gx2, gr2 = torch.autograd.grad(y2.sum(), (x, r))
    assert check.rel_err(y, y2) < 1e-6 and check.rel_err(gx, gx2) < 1e-5 and check.rel_err(gr, gr2) < 1e-5


def test_unsupported_inputs(interpret):
    x = torch.randn(4, 8, dtype=torch.float64)
    w = torch.ones(8, dtype=torch.float64)
    with pytest.raises(KernelUnsupportedError, match="float64"):
        rms_norm(x, w, backend="triton")
    torch.testing.assert_close(rms_norm(x, w), rms_norm_reference(x, w))  # auto: the reference on CPU
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(torch.randn(4, 8), torch.ones(7), backend="triton")
    with pytest.raises(ValueError, match="residual has shape"):
        rms_norm(torch.randn(4, 8), torch.ones(8), residual=torch.randn(4, 9))
    with pytest.raises(KernelUnsupportedError, match="residual has dtype"):
        rms_norm(torch.randn(4, 8), torch.ones(8), residual=torch.randn(4, 8).bfloat16(), backend="triton")
    with pytest.raises(KernelUnsupportedError, match="over the kernel's limit"):
        rms_norm(torch.randn(1, 70000), torch.ones(70000), backend="triton")
