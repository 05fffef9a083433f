"""One block of blockwise attention: the step kernel of ring attention.

A query block attends to one key/value block and returns its output *and* its log-sum-exp (LSE) per query row;
:func:`merge_blocks` combines blocks by online softmax, so the blocks' merged output is exactly attention over all
their keys. The backward of a block takes the *final* (merged) output and LSE: with them the block's share of the
softmax is ``P = exp(S - lse)``, and its gradients are the standard FlashAttention ones
(``dV = Pᵀ dO``, ``dS = P ⊙ (dO Vᵀ - rowsum(dO ⊙ O))``, ``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``) — summed
over the blocks, the gradients of the whole attention.

Document ids (varlen) restrict each query to the keys of its own document (``q_doc [b, s_q]``, ``kv_doc [b, s_kv]``,
negative = padding); ``causal`` is the aligned causal mask of a diagonal block (query ``i`` sees keys ``0..i``).
A query row with no key in the block has output 0 and LSE ``-inf``; nothing divides by zero.

Two implementations, named as in :mod:`loong.core.attention.varlen`: ``reference`` (plain matrix products per
document, in query chunks so the score tensor stays bounded; fp32 arithmetic) and ``flex`` (compiled FlexAttention with a
document block mask; its backward recomputes the block under autograd and feeds the LSE's gradient too).
"""

from __future__ import annotations

import torch

from loong.core.attention.varlen import FLEX, Span, document_spans, flex_attention_call, flex_document_mask

#: the reference computes scores for at most this many (head x query x key) entries at a time
_CHUNK_ELEMENTS = 1 << 24


def merge_blocks(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint keys: ``out [b, h, s, d]`` (fp32) with
    ``lse [b, h, s]`` and a block's; returns the merged pair. Rows empty in both stay 0 with LSE ``-inf``."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isneginf(new), 0.0, new)  # -inf - -inf would be NaN
    merged = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return merged, new


def _segments(q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None, b: int) -> list[tuple[Span, Span]]:
    if q_doc is None:
        return [(slice(None), slice(None))]
    return list(document_spans(q_doc[b], kv_doc[b]))


def _acc(x: torch.Tensor) -> torch.dtype:
    """The dtype blocks compute and accumulate in: fp32, or fp64 for fp64 inputs (tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[h, n, d]`` -> ``[h_kv, groups, n, d]``: query head ``i`` beside key/value head ``i // groups``."""
    return x.reshape(x.shape[0] // groups, groups, *x.shape[1:])


def _chunks(n: int, heads: int, keys: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(1, heads * keys))
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _scores(qq: torch.Tensor, kk: torch.Tensor, scale: float, causal: bool, q0: int) -> torch.Tensor:
    """``[h_kv, g, n, m]`` scaled scores of grouped queries (rows ``q0..q0+n`` of a diagonal block) and keys."""
    s = torch.matmul(qq, kk.unsqueeze(1).transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(q0, q0 + qq.shape[2], device=s.device)[:, None]
        s = s.masked_fill(torch.arange(kk.shape[1], device=s.device)[None, :] > rows, float("-inf"))
    return s


def _reference_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_doc: torch.Tensor | None,
                       kv_doc: torch.Tensor | None, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, sq, _ = q.shape
    g, acc = h // k.shape[1], _acc(q)
    out = q.new_zeros(b, h, sq, v.shape[-1], dtype=acc)
    lse = q.new_full((b, h, sq), float("-inf"), dtype=acc)
    for bi in range(b):
        for qs, ks in _segments(q_doc, kv_doc, bi):
            qq, kk, vv = _grouped(q[bi, :, qs].to(acc), g), k[bi, :, ks].to(acc), v[bi, :, ks].to(acc)
            o_seg, l_seg = [], []
            for a, e in _chunks(qq.shape[2], h, kk.shape[1]):
                s = _scores(qq[:, :, a:e], kk, scale, causal, a)
                lc = torch.logsumexp(s, dim=-1)
                o_seg.append(torch.matmul(torch.exp(s - lc.unsqueeze(-1)), vv.unsqueeze(1)))
                l_seg.append(lc)
            out[bi, :, qs] = torch.cat(o_seg, dim=2).flatten(0, 1)
            lse[bi, :, qs] = torch.cat(l_seg, dim=2).flatten(0, 1)
    return out, lse


def _reference_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h = q.shape[:2]
    g, acc = h // k.shape[1], _acc(q)
    dq = torch.zeros_like(q, dtype=acc)
    dk = torch.zeros_like(k, dtype=acc)
    dv = torch.zeros_like(v, dtype=acc)
    for bi in range(b):
        for qs, ks in _segments(q_doc, kv_doc, bi):
            qq, kk, vv = _grouped(q[bi, :, qs].to(acc), g), k[bi, :, ks].to(acc), v[bi, :, ks].to(acc)
            do, oo = _grouped(dout[bi, :, qs].to(acc), g), _grouped(out[bi, :, qs].to(acc), g)
            ll = _grouped(lse[bi, :, qs].to(acc), g)
            ll = torch.where(torch.isneginf(ll), 0.0, ll)  # a row without keys anywhere: its P is 0 (all -inf)
            dq_seg = []
            dk_seg, dv_seg = torch.zeros_like(kk), torch.zeros_like(vv)
            for a, e in _chunks(qq.shape[2], h, kk.shape[1]):
                p = torch.exp(_scores(qq[:, :, a:e], kk, scale, causal, a) - ll[:, :, a:e].unsqueeze(-1))
                dc = do[:, :, a:e]
                dv_seg += torch.matmul(p.transpose(-1, -2), dc).sum(1)
                dp = torch.matmul(dc, vv.unsqueeze(1).transpose(-1, -2))
                ds = p * (dp - (dc * oo[:, :, a:e]).sum(-1, keepdim=True))
                dq_seg.append(torch.matmul(ds, kk.unsqueeze(1)) * scale)
                dk_seg += torch.matmul(ds.transpose(-1, -2), qq[:, :, a:e]).sum(1) * scale
            dq[bi, :, qs] += torch.cat(dq_seg, dim=2).flatten(0, 1)
            dk[bi, :, ks] += dk_seg
            dv[bi, :, ks] += dv_seg
    return dq, dk, dv


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None,
          causal: bool, scale: float, compile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.nn.attention.flex_attention import AuxRequest

    mask = flex_document_mask(q_doc, kv_doc, causal, q.shape[2], k.shape[2], batch=q.shape[0], device=q.device,
                              compile=compile)
    out, aux = flex_attention_call(compile)(q, k, v, block_mask=mask, scale=scale,
                                            enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _flex_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None, causal: bool,
                   scale: float, compile: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The final output is O = Σ_j w_j O_j with w_j = exp(lse_j - lse); so this block's (O_j, lse_j) get the
    # gradients w_j dO and w_j rowsum(dO ⊙ (O_j - O)), and autograd through FlexAttention does the rest.
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        o_j, lse_j = _flex(qq, kk, vv, q_doc, kv_doc, causal, scale, compile)
        acc = _acc(q)
        lj, oj = lse_j.detach().to(acc), o_j.detach().to(acc)
        safe = torch.where(torch.isneginf(lse), 0.0, lse.to(acc))
        w = torch.where(torch.isneginf(lj), 0.0, torch.exp(lj - safe))
        d = dout.to(acc)
        g_out = (w.unsqueeze(-1) * d).to(o_j.dtype)
        g_lse = w * (d * (oj - out.to(acc))).sum(-1)
        dq, dk, dv = torch.autograd.grad((o_j, lse_j), (qq, kk, vv), (g_out, g_lse.to(lse_j.dtype)))
    return dq.to(acc), dk.to(acc), dv.to(acc)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_doc: torch.Tensor | None = None,
                  kv_doc: torch.Tensor | None = None, *, causal: bool = False, scale: float, impl: str = "reference",
                  compile: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, h, s_q, d_v], lse [b, h, s_q])`` (fp32; fp64 for fp64 inputs) of ``q`` against one key/value block.

    ``q_doc``/``kv_doc``: both or neither. ``compile`` matters for ``flex`` only (``False``: eager FlexAttention,
    forward only on CPU).
    """
    if impl == FLEX:
        out, lse = _flex(q, k, v, q_doc, kv_doc, causal, scale, compile)
        return out.to(_acc(q)), lse.to(_acc(q))
    return _reference_forward(q, k, v, q_doc, kv_doc, causal, scale)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, q_doc: torch.Tensor | None = None, kv_doc: torch.Tensor | None = None, *,
                   causal: bool = False, scale: float, impl: str = "reference", compile: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share ``(dq, dk, dv)`` (fp32; fp64 for fp64 inputs) of the gradients, from the merged ``out`` and ``lse`` of all
    blocks and ``dout``, the gradient of ``out``."""
    if impl == FLEX:
        return _flex_backward(dout, q, k, v, out, lse, q_doc, kv_doc, causal, scale, compile)
    return _reference_backward(dout, q, k, v, out, lse, q_doc, kv_doc, causal, scale)


__all__ = ["block_backward", "block_forward", "merge_blocks"]
