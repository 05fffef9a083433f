"""Backend choice: Triton on CUDA, the reference elsewhere, and clear errors when Triton is insisted on."""

from __future__ import annotations

import sys

import pytest
import torch

import loong.kernels as K
from loong.kernels import _dispatch


def test_auto_on_cpu_takes_the_reference_even_with_the_interpreter_on(interpret, monkeypatch):
    """A leaked TRITON_INTERPRET must not route a CPU run through Python-speed kernels."""
    calls = []
    monkeypatch.setattr(K.norm._RMSNormFn, "apply", lambda *a: calls.append(a))
    x, w = torch.randn(3, 8), torch.ones(8)
    torch.testing.assert_close(K.rms_norm(x, w), K.rms_norm_reference(x, w))
    assert not calls


def test_triton_on_cpu_without_the_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(K.KernelUnsupportedError, match="needs CUDA tensors"):
        K.swiglu(torch.randn(2, 8), backend="triton")


def test_without_triton(monkeypatch):
    monkeypatch.setattr(_dispatch, "triton_available", lambda: False)
    with pytest.raises(K.KernelUnsupportedError, match="Triton is not installed"):
        K.swiglu(torch.randn(2, 8), backend="triton")
    assert K.swiglu(torch.randn(2, 8)).shape == (2, 4)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        K.swiglu(torch.randn(2, 8), backend="cuda")


def test_reference_backend_never_launches(interpret, monkeypatch):
    module = sys.modules["loong.kernels.swiglu"]  # the package attribute of that name is the function
    monkeypatch.setattr(module._SwiGLUFn, "apply", lambda *a: pytest.fail("the Triton path ran"))
    K.swiglu(torch.randn(2, 8), backend="reference")


def test_interpreter_mode_is_read_at_launch(monkeypatch):
    """Kernels follow TRITON_INTERPRET when launched, whatever it was when this package was imported."""
    pytest.importorskip("triton")
    x, w = torch.randn(3, 8), torch.ones(8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(K.KernelUnsupportedError):
        K.rms_norm(x, w, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.testing.assert_close(K.rms_norm(x, w, backend="triton"), K.rms_norm_reference(x, w))
