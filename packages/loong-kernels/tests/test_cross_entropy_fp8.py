"""``fused_linear_cross_entropy(fp8=True)`` under the interpreter (``torch._scaled_mm`` runs on the CPU too).

The oracle is an eager emulation written from the module docstring with the reference quantisers: e4m3 hidden
states and weight (one tensorwise scale each) for the logits, the e5m2 logit gradient (one scale per chunk) times
the e4m3 weight for the hidden gradient, the unquantised logit gradient times the hidden states for the weight
gradient. The kernel must follow it far more closely than it follows fp32 (where FP8's rounding shows), and stay
within FP8's bounds of fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loong.kernels import fused_linear_cross_entropy
from loong.kernels.cross_entropy import fp8_unsupported
from loong.kernels.fp8 import quantize_tensorwise_reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
N, H, V, CHUNK = 48, 32, 80, 16  # three chunks


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    return hidden, weight, labels


def _deq(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    q, s = quantize_tensorwise_reference(x, fp8_dtype=fp8)
    return q.float() * s


def _emulated(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, token_grads: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token losses and the gradients of ``sum(token_grads * losses)``, as the FP8 walk computes them."""
    h, w = hidden.detach(), weight.detach()
    logits = _deq(h, E4M3) @ _deq(w, E4M3).t()
    valid = labels != -100
    losses = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    # per-token losses: forward makes the gradients for an incoming gradient of 1 per counted token (so that is
    # what the e5m2 scale of a chunk sees), backward scales the hidden gradient's rows by the real ones
    dlogits = (torch.softmax(logits, -1) - F.one_hot(labels.clamp(min=0), V).float()) * valid[:, None]
    wq = _deq(w, E4M3)
    dh = torch.cat([_deq(dlogits[i:i + CHUNK], E5M2) @ wq for i in range(0, N, CHUNK)]) * token_grads[:, None]
    return losses, dh, (dlogits * token_grads[:, None]).t() @ h


def _kernel(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, token_grads: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    losses = fused_linear_cross_entropy(h, w, labels, reduction="none", chunk_size=CHUNK, backend="triton", fp8=True)
    (losses * token_grads).sum().backward()
    return losses.detach(), h.grad, w.grad


def _exact(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, token_grads: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    losses = F.cross_entropy(h @ w.t(), labels, ignore_index=-100, reduction="none")
    (losses * token_grads.double()).sum().backward()
    return losses.detach(), h.grad, w.grad


@pytest.mark.parametrize("weights", ["equal", "unequal"])  # unequal: the weight gradient is recomputed in backward
def test_fp8_follows_its_emulation_and_stays_near_fp32(interpret: None, check: object, weights: str) -> None:
    rel_err = check.rel_err  # type: ignore[attr-defined]
    hidden, weight, labels = _inputs()
    token_grads = torch.full((N,), 1.0 / N) if weights == "equal" else torch.rand(N, generator=torch.Generator()
                                                                                  .manual_seed(3)) / N
    got, emulated, exact = (f(hidden, weight, labels, token_grads) for f in (_kernel, _emulated, _exact))
    for name, a, b, c in zip(("losses", "hidden grad", "weight grad"), got, emulated, exact, strict=True):
        to_emulation, to_exact = rel_err(a, b), rel_err(a, c)
        # measured: at most 1.5e-7 from the emulation (the hidden gradient bit for bit), and 0.9% (losses), 3.6%
        # (hidden grad, e5m2) and 1.4% (weight grad) from fp64; without fp8 the first would be the second
        assert to_emulation < 1e-4, (name, to_emulation)
        assert to_exact < 0.08, (name, to_exact)


def test_fp8_rounds_the_gemms(interpret: None) -> None:
    """The same call without ``fp8`` differs from it by FP8's rounding (the flag reaches the GEMMs)."""
    hidden, weight, labels = _inputs(1)
    with torch.no_grad():
        fp8 = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=CHUNK, backend="triton", fp8=True)
        plain = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=CHUNK, backend="triton")
    assert 1e-4 < abs(float(fp8 - plain)) / float(plain) < 0.05, (float(fp8), float(plain))


def test_fp8_refusals(interpret: None) -> None:
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match=r"fp8=True\): vocabulary 72 is not a multiple of 16"):
        fused_linear_cross_entropy(hidden, weight[:72], labels.clamp(max=71), backend="triton", fp8=True)
    with pytest.raises(ValueError, match="needs its Triton path"):
        fused_linear_cross_entropy(hidden, weight, labels, backend="reference", fp8=True)
    assert fp8_unsupported(4096, 128256) is None
    assert fp8_unsupported(2050, 151936) == "hidden size 2050 is not a multiple of 16 (torch._scaled_mm)"
    assert fp8_unsupported(2050, 100) == "hidden size 2050 and vocabulary 100 are not multiples of 16 (torch._scaled_mm)"


def test_fp8_without_the_interpreter_on_cpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="a GPU, or TRITON_INTERPRET=1"):
        fused_linear_cross_entropy(hidden, weight, labels, fp8=True)
