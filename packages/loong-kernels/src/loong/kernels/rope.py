"""Rotary position embeddings: cos/sin tables (llama3 scaling, Qwen-VL M-RoPE) and their application.

The rotation of one head vector ``x`` (``rotary_dim = 2 * r`` leading channels; the rest pass through,
which is partial rotary) is, per frequency ``i < r``::

    y[a_i] = x[a_i] * cos_i - x[b_i] * sin_i
    y[b_i] = x[b_i] * cos_i + x[a_i] * sin_i

with ``(a_i, b_i) = (i, i + r)`` for the rotate-half convention (LLaMA, Qwen, megatron-core's default)
or ``(2i, 2i + 1)`` when ``interleaved`` (GPT-J; megatron-core's ``rotary_interleaved``). This equals
megatron-core's ``t * cos(emb) + rotate_half(t) * sin(emb)`` with ``emb = cat(freqs, freqs)``.

Tables are half-width: ``cos``/``sin`` are ``[s, r]`` (positions shared by the batch) or
``[s, b, r]`` (per-sample positions, e.g. packed documents or M-RoPE), in every layout. They are built
in fp32 by :func:`rope_cos_sin`; frequency scaling (llama3) lives in :func:`rope_inv_freq`, and M-RoPE
only changes which of the three position components feeds each frequency, so one kernel serves all.

The kernel handles any strides of the token and head dimensions (the last one must be contiguous), so
q/k views cut from a fused QKV projection need no copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from loong.kernels._dispatch import Backend, check_float, kernel, next_pow2, use_triton

try:
    import triton.language as tl
except ImportError:  # pragma: no cover
    tl = None

Layout = Literal["sbhd", "bshd", "bhsd", "thd"]
_LAYOUTS = ("sbhd", "bshd", "bhsd", "thd")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """LLaMA 3.1's frequency scaling (the defaults are its published values; HF ``rope_type="llama3"``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_inv_freq(rotary_dim: int, base: float = 10000.0, *, llama3: Llama3RopeScaling | dict | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` (fp32), as megatron-core's ``RotaryEmbedding`` builds them.

    ``rotary_dim`` is ``int(head_dim * rotary_percent)`` for partial rotary. ``llama3`` applies LLaMA 3.1's
    smooth long-context scaling (high frequencies kept, low ones divided by ``factor``, a linear blend
    between).
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope_inv_freq: rotary_dim must be a positive even number, got {rotary_dim}")
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    if llama3 is None:
        return inv
    sc = Llama3RopeScaling(**llama3) if isinstance(llama3, dict) else llama3
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor)
    blended = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _mrope_index(half: int, section: Sequence[int], interleaved: bool, device: torch.device) -> torch.Tensor:
    """For each of the ``half`` frequencies, which position component (0 = t, 1 = h, 2 = w) drives it."""
    if len(section) != 3 or sum(section) != half:
        raise ValueError(f"mrope_section must be 3 numbers summing to rotary_dim // 2 = {half}, got {list(section)}")
    j = torch.arange(half, device=device)
    if interleaved:  # Qwen3-VL: t h w t h w ..., h and w only within their sections' reach
        idx = torch.zeros(half, dtype=torch.long, device=device)
        idx[(j % 3 == 1) & (j < 3 * section[1])] = 1
        idx[(j % 3 == 2) & (j < 3 * section[2])] = 2
        return idx
    return (j >= section[0]).long() + (j >= section[0] + section[1]).long()  # Qwen2-VL / 2.5-VL


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, *, mrope_section: Sequence[int] | None = None,
                 mrope_interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-width fp32 ``cos``/``sin`` tables for :func:`apply_rope`.

    Args:
        position_ids: ``[s]`` (shared by the batch) → tables ``[s, r]``; ``[b, s]`` (per sample, HF's
            convention) → ``[s, b, r]``; with ``mrope_section``, ``[3, b, s]`` (temporal, height, width, as
            Qwen2-VL's ``get_rope_index`` returns) → ``[s, b, r]``.
        inv_freq: ``[r]`` from :func:`rope_inv_freq`.
        mrope_section: Qwen-VL's split of the ``r`` frequencies between t, h and w (e.g. ``[16, 24, 24]``).
        mrope_interleaved: Qwen3-VL's interleaved assignment instead of contiguous sections.
    """
    inv = inv_freq.to(device=position_ids.device, dtype=torch.float32)
    pos = position_ids.to(torch.float32)
    if mrope_section is None:
        if pos.dim() == 1:
            freqs = pos[:, None] * inv
        elif pos.dim() == 2:
            freqs = pos.t()[:, :, None] * inv
        else:
            raise ValueError(f"rope_cos_sin: position_ids must be [s] or [b, s], got {tuple(pos.shape)}")
    else:
        if pos.dim() != 3 or pos.shape[0] != 3:
            raise ValueError(f"rope_cos_sin: M-RoPE position_ids must be [3, b, s], got {tuple(pos.shape)}")
        freqs3 = pos[..., None] * inv  # [3, b, s, r]: the same single fp32 product megatron's outer gives
        idx = _mrope_index(inv.numel(), mrope_section, mrope_interleaved, pos.device)
        freqs = freqs3.gather(0, idx.expand(1, *freqs3.shape[1:])).squeeze(0).transpose(0, 1)
    freqs = freqs.contiguous()
    return freqs.cos(), freqs.sin()


@kernel
def _rope_kernel(X, OUT, XK, OUTK, COS, SIN, n_b, n_heads, n_kheads, rot_half, head_dim, sx_s, sx_b, sx_h, so_s,
                 so_b, so_h, sk_s, sk_b, sk_h, sok_s, sok_b, sok_h, sc_s, sc_b, BACKWARD: tl.constexpr,
                 INTERLEAVED: tl.constexpr, COPY_PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    # One program per token rotates the heads of q (X -> OUT) and then those of k (XK -> OUTK) after a single load
    # of the token's cos/sin: one launch for both. A head block may straddle the two tensors; each head takes its
    # pointers from its own tensor (k's heads are numbered n_heads, n_heads + 1, ...).
    tok = tl.program_id(0)
    si = tok // n_b
    bi = tok - si * n_b
    r = tl.arange(0, BLOCK_R)
    rmask = r < rot_half
    coff = si.to(tl.int64) * sc_s + bi.to(tl.int64) * sc_b + r
    cos = tl.load(COS + coff, mask=rmask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + coff, mask=rmask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of a rotation is the rotation by -angle
        sin = -sin
    if INTERLEAVED:
        d1 = 2 * r
        d2 = 2 * r + 1
    else:
        d1 = r
        d2 = r + rot_half
    xbase = X + si.to(tl.int64) * sx_s + bi.to(tl.int64) * sx_b
    obase = OUT + si.to(tl.int64) * so_s + bi.to(tl.int64) * so_b
    kbase = XK + si.to(tl.int64) * sk_s + bi.to(tl.int64) * sk_b
    okbase = OUTK + si.to(tl.int64) * sok_s + bi.to(tl.int64) * sok_b
    for h0 in range(0, n_heads + n_kheads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        is_q = (h < n_heads)[:, None]
        hk = h - n_heads
        hmask = h < n_heads + n_kheads
        m = hmask[:, None] & rmask[None, :]
        xh = tl.where(is_q, xbase + h[:, None] * sx_h, kbase + hk[:, None] * sk_h)
        oh = tl.where(is_q, obase + h[:, None] * so_h, okbase + hk[:, None] * sok_h)
        x1 = tl.load(xh + d1[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xh + d2[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(oh + d1[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(OUT.dtype.element_ty), mask=m)
        tl.store(oh + d2[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(OUT.dtype.element_ty), mask=m)
        if COPY_PASS:  # partial rotary, out of place: the channels past rotary_dim are copied unchanged
            p = 2 * rot_half + tl.arange(0, BLOCK_P)
            pm = hmask[:, None] & (p < head_dim)[None, :]
            tl.store(oh + p[None, :], tl.load(xh + p[None, :], mask=pm, other=0.0), mask=pm)


def _to_sbhd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "sbhd":
        return t
    if layout == "bshd":
        return t.transpose(0, 1)
    if layout == "bhsd":
        return t.permute(2, 0, 1, 3)
    return t.unsqueeze(1)  # thd: packed tokens, one "batch"


def _from_sbhd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "sbhd":
        return t
    if layout == "bshd":
        return t.transpose(0, 1)
    if layout == "bhsd":
        return t.permute(1, 2, 0, 3)
    return t.squeeze(1)


def _table_strides(cos: torch.Tensor) -> tuple[int, int]:
    if cos.dim() == 2 or cos.shape[1] == 1:
        return cos.stride(0), 0
    return cos.stride(0), cos.stride(1)


def _launch(pairs: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor, sin: torch.Tensor, backward: bool,
            interleaved: bool, copy_pass: bool) -> None:
    """One launch rotating each ``(input, output)`` pair of ``pairs`` (q's, then k's; ``[s, b, heads, dim]`` views)."""
    x4, o4 = pairs[0]
    k4, ok4 = pairs[1] if len(pairs) > 1 else (x4, o4)  # no k: q's pointers with zero heads, never touched
    s, b, heads, dim = x4.shape
    kheads = k4.shape[2] if len(pairs) > 1 else 0
    r = cos.shape[-1]
    if s * b == 0 or heads + kheads == 0:
        return
    block_r = next_pow2(r)
    block_h = min(next_pow2(heads + kheads), max(1, 4096 // block_r))
    block_p = next_pow2(max(dim - 2 * r, 1))
    sc_s, sc_b = _table_strides(cos)
    _rope_kernel[(s * b,)](x4, o4, k4, ok4, cos, sin, b, heads, kheads, r, dim, x4.stride(0), x4.stride(1),
                           x4.stride(2), o4.stride(0), o4.stride(1), o4.stride(2), k4.stride(0), k4.stride(1),
                           k4.stride(2), ok4.stride(0), ok4.stride(1), ok4.stride(2), sc_s, sc_b, BACKWARD=backward,
                           INTERLEAVED=interleaved, COPY_PASS=copy_pass and dim > 2 * r, BLOCK_H=block_h,
                           BLOCK_R=block_r, BLOCK_P=block_p, num_warps=4 if block_h * block_r <= 2048 else 8)


class _RoPEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, layout, interleaved, inplace):
        outs = [None if t is None else t if inplace else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                for t in (q, k)]
        _launch([(_to_sbhd(t, layout), _to_sbhd(o, layout)) for t, o in zip((q, k), outs, strict=True)
                 if t is not None], cos, sin, False, interleaved, not inplace)
        if inplace:
            ctx.mark_dirty(*[t for t in (q, k) if t is not None])
        ctx.save_for_backward(cos, sin)
        ctx.layout, ctx.interleaved = layout, interleaved
        ctx.set_materialize_grads(False)
        return outs[0], outs[1]

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        gs = [None if g is None else g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk)]
        grads = [None if g is None else torch.empty(g.shape, dtype=g.dtype, device=g.device) for g in gs]
        pairs = [(_to_sbhd(g, ctx.layout), _to_sbhd(o, ctx.layout)) for g, o in zip(gs, grads, strict=True)
                 if g is not None]
        if pairs:  # autograd hands dq/dk in q's/k's dtype, which _why_not requires to be one
            _launch(pairs, cos, sin, True, ctx.interleaved, True)
        return grads[0], grads[1], None, None, None, None, None


def _check(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"apply_rope: layout must be one of {_LAYOUTS}, got {layout!r}")
    want = 3 if layout == "thd" else 4
    for name, t in (("q", q), ("k", k)):
        if t is not None and t.dim() != want:
            raise ValueError(f"apply_rope: {name} must be {want}-D for layout {layout!r}, got {tuple(t.shape)}")
    q4 = _to_sbhd(q, layout)
    s, b, _, dim = q4.shape
    if k is not None:
        k4 = _to_sbhd(k, layout)
        if k4.shape[:2] != q4.shape[:2] or k4.shape[3] != dim:
            raise ValueError(f"apply_rope: k {tuple(k.shape)} does not match q {tuple(q.shape)} in tokens/head_dim")
    if cos.shape != sin.shape:
        raise ValueError(f"apply_rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    ok = cos.dim() in (2, 3) and cos.shape[0] == s and (cos.dim() == 2 or cos.shape[1] in (1, b))
    if not ok or 2 * cos.shape[-1] > dim:
        raise ValueError(f"apply_rope: cos/sin must be [s, r] or [s, b, r] with s={s}, b={b}, 2r <= head_dim={dim}"
                         f" (half-width tables from rope_cos_sin), got {tuple(cos.shape)}")


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *,
                         layout: Layout = "sbhd", interleaved: bool = False, inplace: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-PyTorch twin of :func:`apply_rope` (fp32 arithmetic, result in the input dtype)."""
    _check(q, k, cos, sin, layout)
    r = cos.shape[-1]
    c = cos.float().reshape(cos.shape[0], -1, 1, r)
    sn = sin.float().reshape(sin.shape[0], -1, 1, r)
    outs = []
    for t in (q, k):
        if t is None:
            outs.append(None)
            continue
        x = _to_sbhd(t, layout).float()
        rot, rest = x[..., : 2 * r], x[..., 2 * r:]
        x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :r], rot[..., r:])
        y1, y2 = x1 * c - x2 * sn, x2 * c + x1 * sn
        y = torch.stack((y1, y2), -1).flatten(-2) if interleaved else torch.cat((y1, y2), -1)
        out = _from_sbhd(torch.cat((y, rest), -1).to(t.dtype), layout)
        outs.append(t.copy_(out) if inplace else out)
    return outs[0], outs[1]


def _why_not(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    for name, t in (("q", q), ("k", k)):
        if t is None:
            continue
        reason = check_float("apply_rope", t, name)
        if reason:
            return reason
        if t.stride(-1) != 1:
            return f"{name}'s head dimension is not contiguous (stride {t.stride(-1)})"
    if k is not None and k.dtype != q.dtype:
        return f"q is {q.dtype} but k is {k.dtype}"
    if cos.requires_grad or sin.requires_grad:
        return "the kernel gives no gradient for cos/sin"
    return check_float("apply_rope", cos, "cos") or check_float("apply_rope", sin, "sin")


def apply_rope(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *,
               layout: Layout = "sbhd", interleaved: bool = False, inplace: bool = False,
               backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate ``q`` and ``k`` by the angles in ``cos``/``sin``; returns ``(q_out, k_out)``.

    Args:
        q: queries; layout ``"sbhd"`` = megatron-core's ``[s, b, heads, head_dim]`` (the default),
            ``"bshd"`` = ``[b, s, heads, head_dim]``, ``"bhsd"`` = Hugging Face's ``[b, heads, s, head_dim]``,
            ``"thd"`` = packed ``[tokens, heads, head_dim]``. Any strides except the last.
        k: keys in the same layout (may have fewer heads, GQA), or None.
        cos, sin: half-width tables ``[s, r]`` or ``[s, b, r]`` from :func:`rope_cos_sin`; channels from
            ``2r`` to ``head_dim`` pass through unchanged (partial rotary).
        interleaved: pair channels ``(2i, 2i+1)`` instead of ``(i, i+r)``.
        inplace: write the result into ``q``/``k`` (not allowed on views that autograd forbids to modify,
            such as outputs of ``torch.split``); otherwise new contiguous tensors are returned.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
    """
    _check(q, k, cos, sin, layout)
    if not use_triton(backend, "apply_rope", (q, k, cos, sin), _why_not(q, k, cos, sin)):
        return apply_rope_reference(q, k, cos, sin, layout=layout, interleaved=interleaved, inplace=inplace)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return _RoPEFn.apply(q, k, cos, sin, layout, interleaved, inplace)
