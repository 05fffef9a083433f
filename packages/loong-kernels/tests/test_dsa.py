"""DeepSeek sparse attention: the indexer top-k and sparse MLA kernels under the interpreter.

The references are themselves checked against independent formulations (transformers' batched indexer
math, and dense masked attention over the full sequence with the top-k mask), then the kernels against
the references: fp32 to ~1e-5, bf16 against a float64 oracle, autograd by finite differences. Shapes are
small and odd (the interpreter runs one Python op at a time) but cover several head blocks and key blocks,
-1 padding, rows with no valid key and causal edges.
"""

from __future__ import annotations

import sys

import pytest
import torch

from loong.kernels import (
    KernelUnsupportedError,
    indexer_scores_reference,
    indexer_topk,
    indexer_topk_reference,
    sparse_mla_attention,
    sparse_mla_attention_reference,
)

attention_mod = sys.modules["loong.kernels.dsa.attention"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _indexer_inputs(b, s, h, d, dtype=torch.float32, seed=0):
    g = _gen(seed)
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    k = torch.randn(b, s, d, generator=g).to(dtype)
    w = torch.randn(b, s, h, generator=g) * h ** -0.5  # HF folds H_I ** -0.5 into the weights
    return q, k, w


def _selected_scores(scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Scores of the selected keys, sorted per row (-inf for -1 slots): compares sets, robust to ties."""
    vals = scores.gather(-1, idx.long().clamp(min=0)).masked_fill(idx < 0, float("-inf"))
    return vals.sort(-1, descending=True).values


# ---------------------------------------------------------------- the references against independent math


def test_indexer_scores_match_transformers_math():
    """transformers' DeepseekV32Indexer: relu(q @ k^T * D**-0.5), weighted sum over heads, causal mask."""
    q, k, w = _indexer_inputs(2, 11, 4, 16)
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * 16 ** -0.5
    expected = torch.matmul(w.unsqueeze(-2), torch.relu(scores)).squeeze(-2)
    causal = torch.ones(11, 11, dtype=torch.bool).tril()
    expected = expected.masked_fill(~causal, float("-inf"))
    got = indexer_scores_reference(q, k, w)
    assert got.dtype == torch.float32 and got.shape == (2, 11, 11)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # a different scale inside the ReLU, and no mask
    torch.testing.assert_close(indexer_scores_reference(q, k, w, scale=0.5, causal=False),
                               torch.matmul(w.unsqueeze(-2), torch.relu(scores / 16 ** -0.5 * 0.5)).squeeze(-2),
                               rtol=1e-5, atol=1e-5)


def test_indexer_scores_are_differentiable():
    q, k, w = (t.requires_grad_() for t in _indexer_inputs(1, 6, 3, 16))
    scores = indexer_scores_reference(q, k, w)
    scores.masked_fill(torch.isinf(scores), 0).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, w))


def test_indexer_topk_reference_pads_with_minus_one():
    q, k, w = _indexer_inputs(1, 7, 2, 16)
    idx = indexer_topk_reference(q, k, w, 4)
    assert idx.dtype == torch.int32 and idx.shape == (1, 7, 4)
    for t in range(7):
        row = idx[0, t]
        n = min(t + 1, 4)
        assert (row[n:] == -1).all() and (row[:n] >= 0).all() and (row[:n] <= t).all()
    assert (indexer_topk_reference(q, k, w, 9)[..., 7:] == -1).all()  # topk > S


def _dense_attention(q, kv, indices, scale, v_dim):
    """Full [S, S_kv] attention with the top-k mask: an oracle for the gather-based reference."""
    b, s, _, _ = q.shape
    s_kv = kv.shape[1]
    mask = torch.zeros(b, s, s_kv + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where(indices >= 0, indices.long(), s_kv), True)  # -1 goes to a spare column
    mask = mask[..., :s_kv, None].transpose(-1, -2)  # [B, S, 1, S_kv]
    logits = torch.einsum("bshd,btd->bsht", q.double(), kv.double()) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    return torch.einsum("bsht,btd->bshd", probs, kv.double()[..., :v_dim]), lse


def _attention_inputs(b, s, h, d, n_sel, dtype=torch.float32, seed=0, s_kv=None):
    g = _gen(seed)
    s_kv = s if s_kv is None else s_kv
    q = torch.randn(b, s, h, d, generator=g).to(dtype).requires_grad_()
    kv = torch.randn(b, s_kv, d, generator=g).to(dtype).requires_grad_()
    iq, ik, iw = _indexer_inputs(b, s, 4, 16, seed=seed + 1)
    indices = indexer_topk_reference(iq, ik, iw, n_sel)  # causal, -1 padded on the first rows
    indices[0, -1] = -1  # a query with no valid key
    indices[-1, -2, 0] = s_kv  # out of range counts as empty
    return q, kv, indices


def test_reference_matches_dense_masked_attention(check):
    q, kv, idx = _attention_inputs(2, 13, 3, 24, 5, dtype=torch.float64)
    out, lse = sparse_mla_attention_reference(q, kv, idx, softmax_scale=0.37, v_dim=16)
    dense_out, dense_lse = _dense_attention(q, kv, idx.masked_fill(idx >= 13, -1), 0.37, 16)
    assert out.shape == (2, 13, 3, 16) and lse.dtype == torch.float32
    assert check.rel_err(out, dense_out) < 1e-6
    assert (out[0, -1] == 0).all() and torch.isneginf(lse[0, -1]).all() and torch.isneginf(dense_lse[0, -1]).all()
    fin = torch.isfinite(dense_lse)
    assert check.rel_err(lse[fin], dense_lse[fin]) < 1e-6
    probe = torch.randn(out.shape, generator=_gen(5), dtype=torch.float64)
    grads = torch.autograd.grad((out * probe).sum(), (q, kv))
    dense_grads = torch.autograd.grad((dense_out * probe).sum(), (q, kv))
    for a, b in zip(grads, dense_grads, strict=True):
        assert torch.isfinite(a).all() and check.rel_err(a, b) < 1e-6


# ---------------------------------------------------------------- sparse MLA kernel


def _attention_run(fn, q, kv, idx, scale, v_dim, seed=7):
    out, lse = fn(q, kv, idx, softmax_scale=scale, v_dim=v_dim)
    probe = torch.randn(out.shape, generator=_gen(seed))
    return (out, lse, *torch.autograd.grad((out.float() * probe).sum(), (q, kv)))


def _triton_attention(q, kv, idx, **kw):
    return sparse_mla_attention(q, kv, idx, **kw, backend="triton")


@pytest.fixture(params=[False, True], ids=["fused-bwd", "split-bwd"])
def bwd_split(request, monkeypatch):
    """Both backwards: the fused one (dq and atomic dkv per head block) and the split dq + dkv passes."""
    monkeypatch.setattr(attention_mod, "BWD_SPLIT", request.param)
    return request.param


def test_attention_fp32_matches_reference(interpret, check, bwd_split):
    q, kv, idx = _attention_inputs(1, 37, 3, 40, 8)
    got = _attention_run(_triton_attention, q, kv, idx, 0.21, 32)
    ref = _attention_run(sparse_mla_attention_reference, q, kv, idx, 0.21, 32)
    assert got[0].shape == (1, 37, 3, 32) and got[1].dtype == torch.float32 and not got[1].requires_grad
    assert (got[0][0, -1] == 0).all() and torch.isneginf(got[1][0, -1]).all()
    fin = torch.isfinite(ref[1])
    assert torch.equal(fin, torch.isfinite(got[1]))
    assert check.rel_err(got[1][fin], ref[1][fin]) < 1e-6
    for a, b in zip(got[:1] + got[2:], ref[:1] + ref[2:], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert check.rel_err(a, b) < 1e-5


def test_attention_several_head_and_key_blocks(interpret, check, monkeypatch, bwd_split):
    """20 heads in blocks of 16 and 40 keys in blocks of 16 (the last partial): the online softmax and
    the masked head rows; kv longer than the queries; no tail channels (D_qk == v_dim)."""
    small = {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    monkeypatch.setattr(attention_mod, "FWD_CONFIG", small)
    monkeypatch.setattr(attention_mod, "BWD_CONFIG", small)
    monkeypatch.setattr(attention_mod, "DQ_CONFIG", small)
    monkeypatch.setattr(attention_mod, "DKV_CONFIG", small)
    g = _gen(3)
    for d, v_dim in ((24, 24), (48, 16)):
        q = torch.randn(2, 3, 20, d, generator=g).requires_grad_()
        kv = torch.randn(2, 50, d, generator=g).requires_grad_()
        idx = torch.stack([torch.randperm(50, generator=g)[:40] for _ in range(6)]).view(2, 3, 40).int()
        idx[0, 1, 30:] = -1
        got = _attention_run(_triton_attention, q, kv, idx, 0.3, v_dim)
        ref = _attention_run(sparse_mla_attention_reference, q, kv, idx, 0.3, v_dim)
        for a, b in zip(got, ref, strict=True):
            assert check.rel_err(a, b) < 1e-5


def test_attention_split_backward_in_token_chunks(interpret, check, monkeypatch):
    """The split backward with P/dS buffers of 2 tokens: 7 queries in 4 chunks (the last one partial), so every
    chunk's token offset reaches both passes; the same gradients as the reference."""
    monkeypatch.setattr(attention_mod, "BWD_SPLIT", True)
    q, kv, idx = _attention_inputs(2, 7, 3, 40, 8, seed=6)
    monkeypatch.setattr(attention_mod, "SPLIT_BUFFER_BYTES", 2 * 2 * 2 * 8 * 3 * 4)  # 2 tokens x B x K x H fp32, P+dS
    got = _attention_run(_triton_attention, q, kv, idx, 0.21, 32)
    ref = _attention_run(sparse_mla_attention_reference, q, kv, idx, 0.21, 32)
    for a, b in zip(got[:1] + got[2:], ref[:1] + ref[2:], strict=True):
        assert check.rel_err(a, b) < 1e-5


def _eager_low_precision(q, kv, idx, softmax_scale, v_dim):
    """Attention as transformers' eager path runs it in bf16: bf16 matmuls, fp32 softmax, bf16 probabilities.

    The bf16 baseline for the kernel. The reference is fp32 inside and rounds only its outputs, which no
    tensor-core attention matches: like FlashAttention, the kernel feeds P and dS to the dots in bf16.
    """
    b, s, _, d = q.shape
    valid = (idx >= 0) & (idx < kv.shape[1])
    safe = torch.where(valid, idx.long(), 0)
    sel = kv.gather(1, safe.reshape(b, -1, 1).expand(-1, -1, d)).reshape(b, s, -1, d)
    logits = torch.matmul(q, sel.transpose(-1, -2)).float() * softmax_scale
    logits = logits.masked_fill(~valid[:, :, None], float("-inf"))
    probs = torch.softmax(logits, -1).nan_to_num(0.0).to(q.dtype)
    return torch.matmul(probs, sel[..., :v_dim]), None


def test_attention_bf16_no_worse_than_eager(interpret, check, bwd_split):
    q, kv, idx = _attention_inputs(1, 17, 3, 40, 8, dtype=torch.bfloat16, seed=4)
    got = _attention_run(_triton_attention, q, kv, idx, 0.21, 32)
    eager = _attention_run(_eager_low_precision, q, kv, idx, 0.21, 32)
    q64, kv64 = (t.detach().double().requires_grad_() for t in (q, kv))
    exact = _attention_run(sparse_mla_attention_reference, q64, kv64, idx, 0.21, 32)
    assert got[0].dtype == got[2].dtype == got[3].dtype == torch.bfloat16
    for k, r, e in zip(got[:1] + got[2:], eager[:1] + eager[2:], exact[:1] + exact[2:], strict=True):
        check.no_worse(k, r, e)
        assert check.rel_err(k, e) < 1e-2
    fin = torch.isfinite(exact[1])
    assert check.rel_err(got[1][fin], exact[1][fin]) < 1e-3


def test_attention_finite_differences(interpret, check):
    q, kv, idx = _attention_inputs(1, 6, 2, 24, 3, seed=9)
    probe = torch.randn(1, 6, 2, 16, generator=_gen(2))

    def f(q, kv):
        return (sparse_mla_attention(q, kv, idx, softmax_scale=0.4, v_dim=16, backend="triton")[0] * probe).sum()

    analytic, numeric = check.directional_fd(f, [q, kv])
    assert analytic == pytest.approx(numeric, rel=2e-3)


# ---------------------------------------------------------------- indexer kernel


@pytest.mark.parametrize(("b", "s", "topk", "causal", "dtype"), [
    (1, 29, 6, True, torch.float32),  # rows 16..28 need two chunks of 16 and a merge
    (2, 9, 5, False, torch.bfloat16),
    (1, 6, 20, True, torch.float32),  # topk > S: the tail is -1
])
def test_indexer_topk_matches_reference(interpret, b, s, topk, causal, dtype):
    q, k, w = _indexer_inputs(b, s, 5, 24, dtype=dtype, seed=s)
    got = indexer_topk(q, k, w, topk, causal=causal, backend="triton")
    ref = indexer_topk_reference(q, k, w, topk, causal=causal)
    assert got.dtype == torch.int32 and got.shape == (b, s, topk)
    assert torch.equal(got < 0, ref < 0)  # same -1 slots, at the end of each row
    assert (got < s).all() and len(set(got[0, -1].tolist()) - {-1}) == int((got[0, -1] >= 0).sum())
    if causal:
        assert (got <= torch.arange(s)[None, :, None]).all()
    scores = indexer_scores_reference(q, k, w, causal=causal)
    torch.testing.assert_close(_selected_scores(scores, got), _selected_scores(scores, ref), rtol=1e-5, atol=1e-5)
    # best first, as the reference
    vals = scores.gather(-1, got.long().clamp(min=0)).masked_fill(got < 0, float("-inf"))
    assert (vals[..., :-1] >= vals[..., 1:] - 1e-5).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_indexer_topk_of_the_last_queries_is_the_whole_sequences_rows(interpret, backend):
    """Keys ``[B, S_k]`` with the last ``S`` queries (a context-parallel chunk): each query sits at ``S_k - S + t``,
    so its scores, causal mask and top-k are rows ``S_k - S ..`` of the whole sequence's (a chunk needing two
    top-k merges included)."""
    q, k, w = _indexer_inputs(1, 29, 5, 24, seed=3)
    whole = indexer_topk(q, k, w, 6, backend=backend)
    for first in (0, 20):
        last = indexer_topk(q[:, first:], k, w[:, first:], 6, backend=backend)
        scores = indexer_scores_reference(q, k, w)[:, first:]
        torch.testing.assert_close(indexer_scores_reference(q[:, first:], k, w[:, first:]), scores)
        assert torch.equal(last < 0, whole[:, first:] < 0)
        torch.testing.assert_close(_selected_scores(scores, last), _selected_scores(scores, whole[:, first:]),
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"S_k >= 29"):
        indexer_topk(q, k[:, :28], w, 6, backend=backend)


def test_indexer_topk_scale(interpret):
    """The scale sits inside the ReLU; a negative one flips which heads count, so a wrong scale shows."""
    q, k, w = _indexer_inputs(1, 20, 5, 24, seed=1)
    got = indexer_topk(q, k, w, 4, scale=-0.3, backend="triton")
    scores = indexer_scores_reference(q, k, w, scale=-0.3)
    ref = indexer_topk_reference(q, k, w, 4, scale=-0.3)
    torch.testing.assert_close(_selected_scores(scores, got), _selected_scores(scores, ref), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- dispatch


def test_dispatch_and_errors(interpret, monkeypatch):
    q, kv, idx = _attention_inputs(1, 5, 2, 24, 3)
    ref_mod = sys.modules["loong.kernels.dsa"]
    # auto never picks the interpreter: CPU tensors take the reference even with TRITON_INTERPRET set
    monkeypatch.setattr(attention_mod, "sparse_mla_attention_triton", lambda *a, **k: pytest.fail("used Triton"))
    out, _ = sparse_mla_attention(q, kv, idx, softmax_scale=0.3, v_dim=16)
    torch.testing.assert_close(out, sparse_mla_attention_reference(q, kv, idx, softmax_scale=0.3, v_dim=16)[0])
    iq, ik, iw = _indexer_inputs(1, 5, 2, 16)
    torch.testing.assert_close(indexer_topk(iq, ik, iw, 3), indexer_topk_reference(iq, ik, iw, 3))
    assert ref_mod.indexer_topk is indexer_topk
    with pytest.raises(KernelUnsupportedError, match="float64"):
        sparse_mla_attention(q.double(), kv.double(), idx, softmax_scale=0.3, v_dim=16, backend="triton")
    with pytest.raises(KernelUnsupportedError, match="float64"):
        indexer_topk(iq.double(), ik.double(), iw, 3, backend="triton")
    with pytest.raises(KernelUnsupportedError, match="over the kernel's limit"):
        indexer_topk(iq, ik, iw, 10000, backend="triton")
    with pytest.raises(KernelUnsupportedError, match="k has dtype"):
        indexer_topk(iq, ik.bfloat16(), iw, 3, backend="triton")
    with pytest.raises(ValueError, match="v_dim"):
        sparse_mla_attention(q, kv, idx, softmax_scale=0.3, v_dim=25)
    with pytest.raises(ValueError, match="kv has shape"):
        sparse_mla_attention(q, kv[..., :20], idx, softmax_scale=0.3, v_dim=16)
    with pytest.raises(ValueError, match="int32 or int64"):
        sparse_mla_attention(q, kv, idx.float(), softmax_scale=0.3, v_dim=16)
    with pytest.raises(ValueError, match="topk must be"):
        indexer_topk(iq, ik, iw, 0)
    with pytest.raises(ValueError, match="expected k"):
        indexer_topk(iq, ik[:, :4], iw, 3)


def test_triton_needs_cuda_without_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, kv, idx = _attention_inputs(1, 5, 2, 24, 3)
    with pytest.raises(KernelUnsupportedError, match="CUDA"):
        sparse_mla_attention(q, kv, idx, softmax_scale=0.3, v_dim=16, backend="triton")
    iq, ik, iw = _indexer_inputs(1, 5, 2, 16)
    with pytest.raises(KernelUnsupportedError, match="CUDA"):
        indexer_topk(iq, ik, iw, 3, backend="triton")
