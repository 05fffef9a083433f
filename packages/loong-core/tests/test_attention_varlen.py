"""Varlen attention (``loong.core.attention.varlen``): packed documents equal each document attended alone.

The oracle unpacks every document into its own row of a padded batch and runs one masked SDPA call over that
batch; the packed result must match in the output and in the gradients of q, k and v — causal and not, grouped-
query K/V, padding (output 0, no NaN), cross-attention with key document ids.

FlexAttention under torch 2.11 runs on the CPU only eagerly and only forward ("FlexAttention does not support
backward on CPU"); its compiled form takes ~30 s to build on this CPU. So on CPU the ``flex`` implementation is
checked in its forward (eager) against the reference; the GPU tests (``-m gpu``) check compiled FlexAttention
forward and backward, and ring attention's FlexAttention blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loong.core.attention import (
    FLEX,
    REFERENCE,
    block_forward,
    choose_varlen_impl,
    cu_seqlens,
    flex_varlen_attention,
    reference_varlen_attention,
    ring_attention,
    varlen_attention,
)
from loong.core.errors import LoongError

# row 0 ends in padding, row 1 has none; document 1 of row 1 is long, the rest short
DOC_LENGTHS = [[5, 9, 1, 6], [3, 17, 4]]
S = 24


def doc_ids(lengths: list[list[int]] = DOC_LENGTHS, s: int = S) -> torch.Tensor:
    rows = []
    for row in lengths:
        ids = [d for d, n in enumerate(row) for _ in range(n)]
        rows.append(ids + [-1] * (s - len(ids)))
    return torch.tensor(rows)


def qkv(h: int, h_kv: int, s: int = S, s_kv: int | None = None, dtype: torch.dtype = torch.float64,
        seed: int = 0, device: str = "cpu", d: int = 16, d_v: int = 8) -> list[torch.Tensor]:
    """Random q, k, v; the values narrower than the keys (as in multi-latent attention)."""
    g = torch.Generator().manual_seed(seed)
    s_kv = s if s_kv is None else s_kv
    shapes = [(2, h, s, d), (2, h_kv, s_kv, d), (2, h_kv, s_kv, d_v)]
    return [torch.randn(*shape, generator=g, dtype=dtype).to(device).requires_grad_(True) for shape in shapes]


def per_document_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_doc: torch.Tensor,
                        kv_doc: torch.Tensor, causal: bool) -> torch.Tensor:
    """Every document as its own row of a padded batch, one SDPA call with a key-padding (and causal) mask over
    that batch, the rows scattered back; padding queries get 0."""
    pieces = [(b, (q_doc[b] == d).nonzero().flatten(), (kv_doc[b] == d).nonzero().flatten())
              for b in range(q.shape[0]) for d in q_doc[b].unique().tolist() if d >= 0]
    n, lq, lk = len(pieces), max(len(p[1]) for p in pieces), max(len(p[2]) for p in pieces)

    def batch(x: torch.Tensor, which: int, length: int) -> torch.Tensor:
        rows = [F.pad(x[b][:, idx[which - 1]], (0, 0, 0, length - len(idx[which - 1])))
                for b, *idx in pieces]
        return torch.stack(rows)

    qb, kb, vb = batch(q, 1, lq), batch(k, 2, lk), batch(v, 2, lk)
    allowed = torch.zeros(n, 1, lq, lk, dtype=torch.bool)
    for i, (_, _, ki) in enumerate(pieces):
        allowed[i, 0, :, : len(ki)] = True
        if causal:
            allowed[i, 0] &= torch.ones(lq, lk, dtype=torch.bool).tril()
    ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed.to(q.device), enable_gqa=True)
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    for i, (b, qi, _) in enumerate(pieces):
        out[b, :, qi] = ob[i, :, : len(qi)]
    return out


def _grads(out: torch.Tensor, leaves: list[torch.Tensor], seed: int = 5) -> list[torch.Tensor]:
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype).to(out.device)
    return list(torch.autograd.grad(out, leaves, dy))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_reference_equals_each_document_alone(causal: bool, heads: tuple[int, int]) -> None:
    leaves = qkv(*heads)
    doc = doc_ids()
    got = reference_varlen_attention(*leaves, doc, causal=causal)
    want = per_document_oracle(*leaves, doc, doc, causal)
    assert torch.allclose(got, want, atol=1e-12)
    for a, b in zip(_grads(got, leaves), _grads(want, leaves), strict=True):
        assert torch.allclose(a, b, atol=1e-12)
    # documents see only themselves: full attention over the packed row is something else
    dense = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    assert (dense - got).abs().max() > 0.1


def test_padding_gives_zero_and_no_nan() -> None:
    leaves = qkv(4, 2, dtype=torch.float32)
    doc = doc_ids()
    pad = doc < 0
    assert pad[0].sum() == 3 and not pad[1].any()
    for causal in (False, True):
        out = varlen_attention(*leaves, doc, causal=causal)
        dq, dk, dv = _grads(out, leaves)
        assert not any(t.isnan().any() for t in (out, dq, dk, dv))
        assert (out[0, :, pad[0]] == 0).all()
        assert (dq[0, :, pad[0]] == 0).all() and (dk[0, :, pad[0]] == 0).all() and (dv[0, :, pad[0]] == 0).all()
    everything_padding = torch.full((2, S), -1)
    assert (varlen_attention(*leaves, everything_padding) == 0).all()


def test_cross_attention_with_key_document_ids() -> None:
    """Packed queries attend to their own documents' packed context (e.g. a DiT's text tokens per sample)."""
    leaves = qkv(4, 2, s_kv=10)
    doc = doc_ids()
    kv_doc = torch.tensor([[0, 0, 1, 2, 2, 2, 3, -1, -1, -1], [0, 1, 1, 1, 1, 2, 2, 2, 2, -1]])
    got = reference_varlen_attention(*leaves, doc, kv_doc_ids=kv_doc)
    want = per_document_oracle(*leaves, doc, kv_doc, False)
    assert torch.allclose(got, want, atol=1e-12)
    for a, b in zip(_grads(got, leaves), _grads(want, leaves), strict=True):
        assert torch.allclose(a, b, atol=1e-12)
    with pytest.raises(ValueError, match="causal varlen attention is self-attention"):
        reference_varlen_attention(*leaves, doc, kv_doc_ids=kv_doc, causal=True)


def test_a_document_in_two_runs_is_one_document() -> None:
    """Ids, not runs, define documents (FlexAttention's mask compares ids): a split document attends across its gap."""
    leaves = qkv(2, 2, s=8)
    doc = torch.tensor([[0, 0, 1, 1, 0, 0, 0, -1], [0] * 8])
    got = reference_varlen_attention(*leaves, doc)
    want = per_document_oracle(*leaves, doc, doc, False)
    assert torch.allclose(got, want, atol=1e-12)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flex_forward_equals_reference_on_cpu(causal: bool) -> None:
    """Eager FlexAttention (CPU: forward only) with the document block mask; its log-sum-exp as ring blocks use it."""
    q, k, v = (t.detach().float() for t in qkv(4, 2))
    doc = doc_ids()
    want = reference_varlen_attention(q, k, v, doc, causal=causal)
    got = flex_varlen_attention(q, k, v, doc, causal=causal, compile=False)
    assert torch.allclose(got, want, atol=1e-5) and (got[0, :, doc[0] < 0] == 0).all()
    ref_out, ref_lse = block_forward(q, k, v, doc, doc, causal=causal, scale=0.25)
    flex_out, flex_lse = block_forward(q, k, v, doc, doc, causal=causal, scale=0.25, impl=FLEX, compile=False)
    assert torch.allclose(flex_out, ref_out, atol=1e-5)
    real = (doc >= 0)[:, None].expand_as(ref_lse)
    assert torch.allclose(flex_lse[real], ref_lse[real], atol=1e-5)
    assert torch.isneginf(flex_lse[~real]).all() and torch.isneginf(ref_lse[~real]).all()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_masks_are_built_once_per_ids_and_rebuilt_when_the_ids_change() -> None:
    """The layers of a model pass the same ids (or views of them): one mask. New ids, ids written in place, or other
    ids that reuse nothing: a new mask, and the output still equals the reference."""
    from loong.core.attention.varlen import flex_document_mask

    def mask(ids: torch.Tensor) -> object:
        return flex_document_mask(ids, ids, True, S, S, batch=ids.shape[0], device=ids.device, compile=False)

    doc = doc_ids()
    first = mask(doc)
    assert mask(doc) is first and mask(doc[:]) is first  # the same ids, and a view of them
    assert flex_document_mask(doc, doc, False, S, S, batch=2, device=doc.device, compile=False) is not first
    same_values = doc.clone()
    assert mask(same_values) is not first  # other memory: built again (equal ids, equal mask contents)
    q, k, v = (t.detach().float() for t in qkv(4, 2))
    doc[1, 3:] = torch.where(doc[1, 3:] >= 0, 0, doc[1, 3:])  # in place: row 1 becomes one document
    assert mask(doc) is not first
    want = reference_varlen_attention(q, k, v, doc, causal=True)
    got = flex_varlen_attention(q, k, v, doc, causal=True, compile=False)
    assert torch.allclose(got, want, atol=1e-5)


def test_implementation_follows_the_capability() -> None:
    assert choose_varlen_impl(set()) == REFERENCE
    assert choose_varlen_impl({"sdpa", "flex_attention"}) == FLEX
    assert choose_varlen_impl({"flex_attention"}, impl="reference") == REFERENCE
    with pytest.raises(LoongError, match="unknown attention implementation 'flexx'; did you mean 'flex'"):
        choose_varlen_impl(impl="flexx")


def test_cu_seqlens() -> None:
    cu, longest = cu_seqlens(doc_ids())
    # row 0: 5, 9, 1, 6 and 3 padding; row 1 (from 24): 3, 17, 4
    assert cu.tolist() == [0, 5, 14, 15, 21, 24, 27, 44, 48] and cu.dtype == torch.int32 and longest == 17
    # a row that starts with the previous row's last id still starts a segment
    assert cu_seqlens(torch.zeros(2, 4, dtype=torch.long))[0].tolist() == [0, 4, 8]


# --- GPU: compiled FlexAttention, forward and backward -------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compiled_flex_equals_reference_on_gpu(causal: bool) -> None:
    leaves = qkv(8, 2, s=1024, dtype=torch.float32, device="cuda", d=64, d_v=32)  # FlexAttention: widths >= 16
    doc = doc_ids([[100, 300, 7, 200, 150], [1024]], 1024).cuda()
    want = reference_varlen_attention(*leaves, doc, causal=causal)
    got = varlen_attention(*leaves, doc, causal=causal, capabilities={"flex_attention"})
    assert torch.allclose(got, want, atol=2e-5)
    for a, b in zip(_grads(got, leaves), _grads(want, leaves), strict=True):
        assert torch.allclose(a, b, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flex_ring_blocks_equal_reference_on_gpu(causal: bool) -> None:
    """Blockwise attention's FlexAttention blocks (forward with LSE; backward through autograd with the LSE's
    gradient) against the reference blocks, on one rank."""
    leaves = qkv(8, 2, s=512, dtype=torch.float32, device="cuda", d=64, d_v=32)
    doc = doc_ids([[100, 300, 7], [512]], 512).cuda()
    want = ring_attention(*leaves, None, doc_ids=doc, causal=causal, impl=REFERENCE)
    got = ring_attention(*leaves, None, doc_ids=doc, causal=causal, impl=FLEX)
    assert torch.allclose(got, want, atol=2e-5) and not got.isnan().any()
    for a, b in zip(_grads(got, leaves), _grads(want, leaves), strict=True):
        assert torch.allclose(a, b, atol=1e-4) and not a.isnan().any()
