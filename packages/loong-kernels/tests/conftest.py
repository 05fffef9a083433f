"""Shared fixtures: Triton's interpreter for the CPU tests, and comparison helpers."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run Triton kernels under the interpreter for this test (kernels pick the mode at launch)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (NaN anywhere counts as a failure)."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def no_worse(kernel: torch.Tensor, ref_low: torch.Tensor, exact: torch.Tensor, slack: float = 3.0,
             floor: float = 1e-6) -> None:
    """The kernel's error against the float64 ``exact`` is at most ``slack`` x the low-precision reference's.

    This is the oracle for bf16: both round, so neither matches exactly, but the kernel (fp32 inside)
    must be about as accurate as the plain-PyTorch path in the same dtype. The default slack is 3 because
    Triton's interpreter casts fp32 to bf16 by truncation (measured: half the values differ from
    round-to-nearest, always toward zero), which doubles the rounding error; GPU tests use less.
    """
    ek, er = rel_err(kernel, exact), rel_err(ref_low, exact)
    assert ek <= slack * er + floor, f"kernel error {ek:.3e} vs reference error {er:.3e}"


def directional_fd(f, inputs: list[torch.Tensor], eps: float = 1e-2, seed: int = 0) -> tuple[float, float]:
    """Finite-difference check of autograd through ``f`` (a scalar function), independent of any reference.

    Returns ``(analytic, numeric)`` directional derivatives along a random direction.
    """
    gen = torch.Generator().manual_seed(seed)
    dirs = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) for t in inputs]
    out = f(*inputs)
    grads = torch.autograd.grad(out, inputs)
    analytic = sum(float((g.double() * d.double()).sum()) for g, d in zip(grads, dirs, strict=True))
    with torch.no_grad():
        plus = f(*[t + eps * d for t, d in zip(inputs, dirs, strict=True)])
        minus = f(*[t - eps * d for t, d in zip(inputs, dirs, strict=True)])
    return analytic, float(plus.double() - minus.double()) / (2 * eps)


@pytest.fixture
def check():
    """The comparison helpers above, as a fixture (test modules cannot import conftest by name)."""
    import types

    return types.SimpleNamespace(rel_err=rel_err, no_worse=no_worse, directional_fd=directional_fd)
