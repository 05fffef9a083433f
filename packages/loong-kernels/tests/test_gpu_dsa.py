"""The compiled DSA kernels on a GPU at DeepSeek-V3.2-like shapes, against the references.

Run on a CUDA machine: ``pytest packages/loong-kernels/tests/test_gpu_dsa.py -m gpu``.

bf16 tolerances: the oracle is the fp32 reference on the bf16 inputs (upcast, so the inputs are exact),
and the kernel's relative error must be at most 1.5x that of eager bf16 attention (transformers' eager
path: bf16 matmuls, fp32 softmax, bf16 probabilities) plus 1e-3, and below 1e-2 outright. The indexer's
selected sets must score the same as the reference's within fp32 rounding (rtol 1e-4): near-ties may
swap tokens, never change which scores were picked beyond rounding.
"""

from __future__ import annotations

import sys

import pytest
import torch

import loong.kernels as K

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.manual_seed(0)


@pytest.fixture(params=[False, True], ids=["fused-bwd", "split-bwd"])
def bwd_split(request, monkeypatch):
    """Both backwards: the fused one and the split dq pass + dkv pass over stored P and dS."""
    from loong.kernels.dsa import attention

    monkeypatch.setattr(attention, "BWD_SPLIT", request.param)
    return request.param


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


def _indices(s, topk, heads=8, dim=64):
    q = torch.randn(1, s, heads, dim, device="cuda").bfloat16()
    k = torch.randn(1, s, dim, device="cuda").bfloat16()
    w = torch.randn(1, s, heads, device="cuda") * heads ** -0.5
    return K.indexer_topk(q, k, w, topk, backend="triton")


def _eager_bf16(q, kv, idx, softmax_scale, v_dim):
    """transformers' eager attention in bf16 over the gathered keys (the baseline a bf16 kernel must match)."""
    b, s, _, d = q.shape
    valid = idx >= 0
    sel = kv.gather(1, torch.where(valid, idx.long(), 0).reshape(b, -1, 1).expand(-1, -1, d)).reshape(b, s, -1, d)
    logits = torch.matmul(q, sel.transpose(-1, -2)).float() * softmax_scale
    probs = torch.softmax(logits.masked_fill(~valid[:, :, None], float("-inf")), -1).nan_to_num(0.0).to(q.dtype)
    return torch.matmul(probs, sel[..., :v_dim]), None


def _run(fn, q, kv, idx, scale, v_dim, probe):
    out, lse = fn(q, kv, idx, softmax_scale=scale, v_dim=v_dim)
    return (out, lse, *torch.autograd.grad((out.float() * probe).sum(), (q, kv)))


@pytest.mark.parametrize(("s", "topk", "heads"), [(4096, 2048, 16), (2048, 1024, 128)])
def test_sparse_mla_bf16(s, topk, heads, bwd_split):
    d, v_dim = 576, 512
    q = torch.randn(1, s, heads, d, device="cuda").bfloat16().requires_grad_()
    kv = torch.randn(1, s, d, device="cuda").bfloat16().requires_grad_()
    idx = _indices(s, topk)
    scale = d ** -0.5
    probe = torch.randn(1, s, heads, v_dim, device="cuda")
    got = _run(lambda *a, **k: K.sparse_mla_attention(*a, **k, backend="triton"), q, kv, idx, scale, v_dim, probe)
    e_out, _, e_dq, e_dkv = _run(_eager_bf16, q, kv, idx, scale, v_dim, probe)
    q32, kv32 = (t.detach().float().requires_grad_() for t in (q, kv))
    exact = _run(K.sparse_mla_attention_reference, q32, kv32, idx, scale, v_dim, probe)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    for name, k, e, r in zip(("out", "dq", "dkv"), (got[0], got[2], got[3]), (exact[0], exact[2], exact[3]),
                             (e_out, e_dq, e_dkv), strict=True):
        ek, er = _rel(k, e), _rel(r, e)
        assert ek <= 1.5 * er + 1e-3 and ek < 1e-2, f"{name}: kernel {ek:.3e} vs eager bf16 {er:.3e}"
    assert _rel(got[1], exact[1]) < 1e-4


def test_sparse_mla_fp32_matches_reference(bwd_split):
    s, heads, d, v_dim = 512, 20, 576, 512
    q = torch.randn(1, s, heads, d, device="cuda", requires_grad=True)
    kv = torch.randn(1, s, d, device="cuda", requires_grad=True)
    idx = _indices(s, 256)
    probe = torch.randn(1, s, heads, v_dim, device="cuda")
    got = _run(lambda *a, **k: K.sparse_mla_attention(*a, **k, backend="triton"), q, kv, idx, 0.05, v_dim, probe)
    ref = _run(K.sparse_mla_attention_reference, q, kv, idx, 0.05, v_dim, probe)
    for a, b in zip(got, ref, strict=True):
        assert _rel(a, b) < 1e-5


def test_sparse_mla_beyond_65535_tokens(bwd_split):
    """More tokens than CUDA's grid axes 1 and 2 allow (65535): every row must still be computed."""
    s, heads, d, v_dim, topk = 70_000, 16, 576, 512, 16
    q = torch.randn(1, s, heads, d, device="cuda", requires_grad=True)
    kv = torch.randn(1, s, d, device="cuda", requires_grad=True)
    # each token attends to itself and its 15 predecessors (fewer at the start: -1 pads)
    idx = torch.arange(s, device="cuda")[:, None] - torch.arange(topk, device="cuda")[None, :]
    idx = torch.where(idx >= 0, idx, -1).int()[None]
    probe = torch.randn(1, s, heads, v_dim, device="cuda")
    got = _run(lambda *a, **k: K.sparse_mla_attention(*a, **k, backend="triton"), q, kv, idx, 0.05, v_dim, probe)
    ref = _run(K.sparse_mla_attention_reference, q, kv, idx, 0.05, v_dim, probe)
    for a, b in zip(got, ref, strict=True):
        assert _rel(a[:, -100:], b[:, -100:]) < 1e-5  # the last rows, past the old limit
        assert _rel(a, b) < 1e-5


def test_sparse_mla_head_strides_past_int32(bwd_split):
    """q and dout in head-major memory ``[h, s, c]`` (what einsum's backward hands the kernel in DSA's absorbed
    attention): 127 heads x the head stride exceed 2**31 elements. The results must be bit-identical to the same
    values laid out contiguously; before the offsets were int64 this produced NaN in dq at 64K tokens."""
    s, heads, d, v_dim, topk = 40_000, 128, 576, 512, 16
    assert (heads - 1) * s * v_dim > 2**31
    q_hm = torch.randn(heads, s, d, device="cuda", dtype=torch.bfloat16)
    do_hm = torch.randn(heads, s, v_dim, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, s, d, device="cuda", dtype=torch.bfloat16)
    idx = torch.arange(s, device="cuda")[:, None] - torch.arange(topk, device="cuda")[None, :]
    idx = torch.where(idx >= 0, idx, -1).int()[None]
    def head_major(t):  # [h, s, c] memory as [1, s, h, c]
        return t.permute(1, 0, 2).unsqueeze(0)

    assert head_major(q_hm).stride(2) == s * d and head_major(do_hm).stride(2) == s * v_dim
    results = []
    for layout in (head_major, lambda t: head_major(t).contiguous()):
        q, kv_ = layout(q_hm).requires_grad_(), kv.clone().requires_grad_()
        out, lse = K.sparse_mla_attention(q, kv_, idx, softmax_scale=0.05, v_dim=v_dim, backend="triton")
        out.backward(layout(do_hm))
        results.append((out.detach(), lse, q.grad, kv_.grad))
        del q, kv_, out, lse
    for name, a, b in zip(("out", "lse", "dq", "dkv"), *results, strict=True):
        assert torch.isfinite(a).all(), name
        if name == "dkv":  # fp32 atomics in any order, then rounded to bf16: last-bit differences
            assert _rel(a, b) < 1e-3, name
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_topk(dtype):
    s, heads, dim, topk = 4096, 64, 128, 2048
    q = torch.randn(1, s, heads, dim, device="cuda").to(dtype)
    k = torch.randn(1, s, dim, device="cuda").to(dtype)
    w = torch.randn(1, s, heads, device="cuda") * heads ** -0.5
    got = K.indexer_topk(q, k, w, topk, backend="triton")
    ref = K.indexer_topk_reference(q, k, w, topk)
    assert torch.equal(got < 0, ref < 0)
    scores = K.indexer_scores_reference(q, k, w)

    def picked(ix):
        vals = scores.gather(-1, ix.long().clamp(min=0)).masked_fill(ix < 0, float("-inf"))
        return vals.sort(-1, descending=True).values

    torch.testing.assert_close(picked(got), picked(ref), rtol=1e-4, atol=1e-4)
    assert (got <= torch.arange(s, device="cuda")[None, :, None]).all()


def test_indexer_topk_of_a_late_chunk_of_queries():
    """Context parallelism's call: the last quarter of the queries against every key (bottom-right causal) picks
    the whole sequence's rows' keys."""
    s, heads, dim, topk = 4096, 64, 128, 2048
    q = torch.randn(1, s, heads, dim, device="cuda").bfloat16()
    k = torch.randn(1, s, dim, device="cuda").bfloat16()
    w = torch.randn(1, s, heads, device="cuda") * heads ** -0.5
    first = 3 * s // 4
    got = K.indexer_topk(q[:, first:], k, w[:, first:], topk, backend="triton")
    whole = K.indexer_topk(q, k, w, topk, backend="triton")[:, first:]
    scores = K.indexer_scores_reference(q[:, first:], k, w[:, first:])

    def picked(ix):
        vals = scores.gather(-1, ix.long().clamp(min=0)).masked_fill(ix < 0, float("-inf"))
        return vals.sort(-1, descending=True).values

    assert torch.equal(got < 0, whole < 0)
    torch.testing.assert_close(picked(got), picked(whole), rtol=1e-4, atol=1e-4)
    assert (got <= torch.arange(first, s, device="cuda")[None, :, None]).all()


def test_auto_dispatch_uses_the_kernels_on_cuda(monkeypatch):
    dsa = sys.modules["loong.kernels.dsa"]
    monkeypatch.setattr(dsa, "sparse_mla_attention_reference", lambda *a, **k: pytest.fail("fell back"))
    monkeypatch.setattr(dsa, "indexer_topk_reference", lambda *a, **k: pytest.fail("fell back"))
    idx = K.indexer_topk(torch.randn(1, 64, 4, 32, device="cuda"), torch.randn(1, 64, 32, device="cuda"),
                         torch.randn(1, 64, 4, device="cuda"), 16)
    out, _ = K.sparse_mla_attention(torch.randn(1, 64, 16, 576, device="cuda").bfloat16(),
                                    torch.randn(1, 64, 576, device="cuda").bfloat16(), idx,
                                    softmax_scale=0.05, v_dim=512)
    assert out.is_cuda
