"""Fused linear + cross-entropy: the chunked kernel under the interpreter against the eager reference."""

from __future__ import annotations

import pytest
import torch

from loong.kernels import (
    KernelUnsupportedError,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)


def _problem(lead=(3, 7), hidden=24, vocab=5000, dtype=torch.float32, ignored=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, hidden, generator=g).to(dtype).requires_grad_()
    w = (0.5 * torch.randn(vocab, hidden, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, lead, generator=g)
    labels.view(-1)[torch.randperm(labels.numel(), generator=g)[:ignored]] = -100
    return h, w, labels


def _loss_grads(fn, h, w, labels, scale=1.0, **kw):
    loss = fn(h, w, labels, **kw)
    return loss, torch.autograd.grad(loss * scale, (h, w))


def _triton(*a, **k):
    return fused_linear_cross_entropy(*a, **k, backend="triton")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("chunk_size", [None, 8])  # one chunk; uneven chunks (21 tokens in 8s)
def test_fp32_matches_reference(interpret, check, reduction, z_loss, chunk_size):
    h, w, labels = _problem()
    lk, gk = _loss_grads(_triton, h, w, labels, 3.0, z_loss=z_loss, reduction=reduction, chunk_size=chunk_size)
    lr, gr = _loss_grads(fused_linear_cross_entropy_reference, h, w, labels, 3.0, z_loss=z_loss, reduction=reduction)
    assert lk.dtype == torch.float32 and lk.dim() == 0
    assert float(lk.detach()) == pytest.approx(float(lr.detach()), rel=1e-5)
    for a, b in zip(gk, gr, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert check.rel_err(a, b) < 1e-5


def test_bf16_no_worse_than_reference(interpret, check):
    h, w, labels = _problem(dtype=torch.bfloat16, vocab=3000)
    lk, gk = _loss_grads(_triton, h, w, labels, z_loss=1e-3, chunk_size=16)
    lr, gr = _loss_grads(fused_linear_cross_entropy_reference, h, w, labels, z_loss=1e-3)
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    le, ge = _loss_grads(fused_linear_cross_entropy_reference, h64, w64, labels, z_loss=1e-3)
    assert abs(float(lk.detach()) - float(le.detach())) <= 3 * abs(float(lr.detach()) - float(le.detach())) + 1e-4
    for a, r, e in zip(gk, gr, ge, strict=True):
        assert a.dtype == torch.bfloat16
        check.no_worse(a, r, e)


def test_finite_differences(interpret, check):
    h, w, labels = _problem(lead=(6,), hidden=8, vocab=300, ignored=1)
    analytic, numeric = check.directional_fd(
        lambda h, w: _triton(h, w, labels, z_loss=1e-2, chunk_size=4), [h, w], eps=1e-2)
    assert analytic == pytest.approx(numeric, rel=2e-3)


def test_all_ignored_gives_zero_not_nan(interpret):
    h, w, labels = _problem(lead=(4,), vocab=100, ignored=0)
    labels[:] = -100
    loss, (gh, gw) = _loss_grads(_triton, h, w, labels)
    assert float(loss.detach()) == 0.0 and not gh.any() and not gw.any()
    assert float(fused_linear_cross_entropy_reference(h, w, labels).detach()) == 0.0


def test_frozen_weight_no_grad_and_int32_labels(interpret, check):
    h, w, labels = _problem(lead=(9,), vocab=200)
    w = w.detach()
    loss = _triton(h, w, labels.int())
    (gh,) = torch.autograd.grad(loss, h)
    (gh_ref,) = torch.autograd.grad(fused_linear_cross_entropy_reference(h, w, labels), h)
    assert check.rel_err(gh, gh_ref) < 1e-5
    with torch.no_grad():
        assert float(_triton(h, w, labels)) == pytest.approx(float(loss.detach()), rel=1e-6)


def test_custom_ignore_index(interpret):
    h, w, labels = _problem(lead=(10,), vocab=50, ignored=0)
    labels[:3] = 7
    a = _triton(h, w, labels, ignore_index=7)
    b = fused_linear_cross_entropy_reference(h, w, labels, ignore_index=7)
    assert float(a.detach()) == pytest.approx(float(b.detach()), rel=1e-5)


def test_bad_inputs(interpret):
    h, w, labels = _problem(lead=(4,), vocab=50, ignored=0)
    bad = labels.clone()
    bad[1] = 50
    with pytest.raises(ValueError, match="labels outside"):
        _triton(h, w, bad)
    with pytest.raises(ValueError, match="must match hidden's leading"):
        _triton(h, w, labels[:3])
    with pytest.raises(ValueError, match="is not \\[vocab"):
        _triton(h, w[:, :5], labels)
    with pytest.raises(ValueError, match="int64/int32"):
        _triton(h, w, labels.float())
    with pytest.raises(ValueError, match="reduction"):
        _triton(h, w, labels, reduction="max")
    with pytest.raises(KernelUnsupportedError, match="hidden is torch.bfloat16 but weight"):
        _triton(h.bfloat16(), w, labels)
    with pytest.raises(ValueError, match="chunk_size"):
        _triton(h, w, labels, chunk_size=0)
    # auto on CPU takes the reference, any float dtype
    assert torch.isfinite(fused_linear_cross_entropy(h.double(), w.double(), labels))


def test_weight_dtype_accumulation(interpret, check):
    """fp32_accumulate=False keeps the weight gradient in bf16 between chunks: close, and in bf16."""
    h, w, labels = _problem(dtype=torch.bfloat16, vocab=700)
    _, (gh32, gw32) = _loss_grads(_triton, h, w, labels, chunk_size=4)
    _, (gh16, gw16) = _loss_grads(_triton, h, w, labels, chunk_size=4, fp32_accumulate=False)
    assert gw16.dtype == torch.bfloat16 and torch.equal(gh16, gh32)
    assert check.rel_err(gw16, gw32) < 2e-2


def test_second_backward_is_refused(interpret):
    h, w, labels = _problem(lead=(5,), vocab=60)
    loss = _triton(h, w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def _token_weights(labels, kind, seed=3):
    """Incoming per-token gradients: equal on counted tokens (a masked mean), or not (a loss mask the
    labels do not carry, or arbitrary weights)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "equal":  # ignored tokens may carry any value
        return torch.where(labels == -100, torch.rand(labels.shape, generator=g), 1 / 7)
    if kind == "masked":
        return (torch.rand(labels.shape, generator=g) < 0.6).float() / 5
    return torch.rand(labels.shape, generator=g)


@pytest.mark.parametrize("kind", ["equal", "masked", "random"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("chunk_size", [None, 8])
def test_per_token_losses_fp32(interpret, check, monkeypatch, kind, z_loss, chunk_size):
    """reduction="none": per-token losses, and exact gradients for equal (scaled) and unequal (recomputed)
    per-token weights."""
    import loong.kernels.cross_entropy as ce

    walks = []
    chunks = ce._chunks
    monkeypatch.setattr(ce, "_chunks", lambda *a, **k: walks.append(1) or chunks(*a, **k))
    h, w, labels = _problem()
    weights = _token_weights(labels, kind)
    lk = _triton(h, w, labels, z_loss=z_loss, reduction="none", chunk_size=chunk_size)
    lr = fused_linear_cross_entropy_reference(h, w, labels, z_loss=z_loss, reduction="none")
    assert lk.shape == labels.shape and lk.dtype == torch.float32
    assert check.rel_err(lk, lr) < 1e-6 and not lk[labels == -100].any()
    gk = torch.autograd.grad((lk * weights).sum(), (h, w))
    gr = torch.autograd.grad((lr * weights).sum(), (h, w))
    for a, b in zip(gk, gr, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert check.rel_err(a, b) < 1e-5
    assert len(walks) == (1 if kind == "equal" else 2)  # equal weights: no recomputation


def test_per_token_losses_bf16_and_frozen_weight(interpret, check):
    h, w, labels = _problem(dtype=torch.bfloat16, vocab=900)
    weights = _token_weights(labels, "masked")
    gk = torch.autograd.grad((_triton(h, w, labels, reduction="none", chunk_size=8) * weights).sum(), (h, w))
    gr = torch.autograd.grad((fused_linear_cross_entropy_reference(h, w, labels, reduction="none") * weights).sum(),
                             (h, w))
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    ge = torch.autograd.grad((fused_linear_cross_entropy_reference(h64, w64, labels, reduction="none")
                              * weights.double()).sum(), (h64, w64))
    for a, r, e in zip(gk, gr, ge, strict=True):
        assert a.dtype == torch.bfloat16
        check.no_worse(a, r, e)
    # frozen weight (LoRA): only the hidden gradient, row-scaled, nothing to recompute
    h32, w32, labels = _problem(lead=(9,), vocab=200)
    weights = _token_weights(labels, "random")
    (gh,) = torch.autograd.grad((_triton(h32, w32.detach(), labels, reduction="none") * weights).sum(), h32)
    (gh_ref,) = torch.autograd.grad(
        (fused_linear_cross_entropy_reference(h32, w32.detach(), labels, reduction="none") * weights).sum(), h32)
    assert check.rel_err(gh, gh_ref) < 1e-5
