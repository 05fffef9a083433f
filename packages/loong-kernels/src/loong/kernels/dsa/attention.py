"""Triton sparse MLA attention (MQA mode) over indexer-selected tokens: forward and backward.

Layout: ``q [B, S, H, D]``, ``kv [B, S_kv, D]`` (one latent row per token shared by every head; the value is
its first ``v_dim`` channels), ``indices [B, S, K]``. A row's ``D`` channels are split into the *value part*
``[0, v_dim)`` and the *tail* ``[v_dim, D)`` (the 64 RoPE channels in V3.2), each padded to a power of two,
so D = 576 costs 512 + 64 lanes rather than 1024.

Forward: one program per (head block, token) and batch. It loads ``BLOCK_H`` heads of the query once and walks
the token's selected keys ``BLOCK_N`` at a time: the gathered kv tile ``[BLOCK_N, D]`` is read once and used
by all ``BLOCK_H`` heads for both ``q . k`` and ``p @ v`` (this sharing, as in FlashMLA's sparse kernel, is
where the speed comes from: with H = 128 and BLOCK_H = 64 each selected row is gathered twice per token
instead of 128 times). The softmax is online, in base 2, with fp32 statistics.

Backward, two passes (the default, ``BWD_SPLIT``). The dq pass has the forward's grid: each program recomputes
its probabilities from the saved log-sum-exp, keeps ``dq`` for its heads in registers, and stores the
probabilities P and the score gradients dS (bf16, ``[B, tokens, K, H]``, a chunk of tokens at a time so the two
buffers stay under ``SPLIT_BUFFER_BYTES``, 1 GiB). The dkv pass, one program per (key tile, token), reads them
and adds ``dS^T q + P^T dO`` summed over every head into an fp32 ``[B, S_kv, D]`` buffer, one ``tl.atomic_add``
per element and tile. Nothing is computed twice (q.k is recomputed once from the log-sum-exp, as in any
flash-style backward); without a dkv accumulator the dq pass holds 64-head blocks, whose
dots are large enough for Hopper's wgmma, and the dkv pass's dots reduce over the heads. Measured on an H200 at
V3.2's shape: 170 TFLOP/s at 8K tokens, 156 at 64K (``benchmarks/dsa_bwd_sweep.py``, docs/kernels.md).

Atomics were chosen over a deterministic scheme because a token is selected by a data-dependent, very uneven
number of queries (the first tokens by nearly all of them): a sort-based inverse index would need the
attention recomputed from the key side or the per-(query, head, key) values kept for the whole sequence. The
price is run-to-run bit differences in ``dkv`` (fp32 sums in a varying order) and ``4 * B * S_kv * D`` bytes
for the buffer.

Fused backward (``BWD_SPLIT = False``, 98 TFLOP/s at 8K): one kernel computes dq and adds dk + dv per head
block with atomics, holding both accumulators: it needs no P/dS buffers, and
its 32-head blocks stay on the older mma instructions.
"""

from __future__ import annotations

import math

import torch

from loong.kernels._dispatch import cdiv, interpreting, kernel, next_pow2

try:
    import triton.language as tl
except ImportError:  # pragma: no cover
    tl = None

_LOG2E = math.log2(math.e)

# Block configurations (BLOCK_H, BLOCK_N, num_warps, num_stages). The benchmark can override them to tune
# on a new GPU (``benchmarks/dsa.py --fwd-config/--bwd-config/--dq-config/--dkv-config``).
# Measured on the H200 (S=8K, H=128, D_qk=576, top-k 2048): forward 64/64/8/1 at 206 TFLOP/s (64/64/8 with 2
# stages needs 312 KB of shared memory; the limit is 227 KB). The two-pass backward: dq pass 64/64/8/1 and dkv
# pass 64/32/8/2 at 170 TFLOP/s (156 at 64K); with 1 stage 156 (141), a dkv pass of 64/64 ran at 48, of 128 heads
# or 3 stages out of shared memory (benchmarks/results/dsa_bwd_sweep_h200_*). The fused backward (BWD_CONFIG) holds dq and a dkv
# tile for BLOCK_H heads, so 32/32/8/1 (85-98 TFLOP/s) is the largest that fits.
FWD_CONFIG: dict[str, int] = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1}
BWD_CONFIG: dict[str, int] = {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1}
BWD_SPLIT = True
DQ_CONFIG: dict[str, int] = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1}
DKV_CONFIG: dict[str, int] = {"BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
SPLIT_BUFFER_BYTES = 1 << 30
_MAX_DIM = 1024  # padded value part; wider rows would not fit the tiles


@kernel
def _sparse_mla_fwd(Q, KV, IDX, OUT, LSE,
                    sq_b, sq_s, sq_h, skv_b, skv_s, si_b, si_s, so_b, so_s, so_h, sl_b, sl_s,
                    n_heads, s_kv, n_sel, v_dim, d_tail, qk_scale,
                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_T: tl.constexpr, HAS_TAIL: tl.constexpr, EVEN_V: tl.constexpr,
                    EVEN_T: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # (head block, token) share grid axis 0: axis 1 is capped at 65535 (a 64K sequence overflows it), and the
    # head blocks of one token stay adjacent, so they read its gathered kv rows while those are in L2.
    n_hb = tl.cdiv(n_heads, BLOCK_H)
    hb, tok, bat = tl.program_id(0) % n_hb, (tl.program_id(0) // n_hb).to(tl.int64), tl.program_id(1).to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    # int64 before the head stride: a strided dout (einsum's backward gives [h, s, c] memory) has a head stride
    # of s * c, and 127 * 65536 * 512 overflows int32 (it did at 64K tokens: NaN in dq)
    h_off = heads.to(tl.int64)[:, None]
    dv = tl.arange(0, BLOCK_V)
    # With the part exactly as wide as its tile the channel mask is a compile-time constant, which lets Triton
    # prove 16-byte alignment and use vector loads and (in the backward) v4 atomics: 3x fewer atomic
    # instructions at V3.2's 512 + 64 (checked in the PTX).
    if EVEN_V:
        vmask = dv < BLOCK_V
    else:
        vmask = dv < v_dim
    q_row = Q + bat * sq_b + tok * sq_s + h_off * sq_h
    q_v = tl.load(q_row + dv[None, :], mask=hmask[:, None] & vmask[None, :], other=0.0)
    if UPCAST:
        q_v = q_v.to(tl.float32)
    if HAS_TAIL:
        dt = tl.arange(0, BLOCK_T)
        if EVEN_T:
            tmask = dt < BLOCK_T
        else:
            tmask = dt < d_tail
        q_t = tl.load(q_row + v_dim + dt[None, :], mask=hmask[:, None] & tmask[None, :], other=0.0)
        if UPCAST:
            q_t = q_t.to(tl.float32)
    kv_base = KV + bat * skv_b
    idx_base = IDX + bat * si_b + tok * si_s
    # A finite floor instead of -inf keeps exp2(m_old - m_new) defined while no key has been valid yet.
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    for start in range(0, n_sel, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_base + offs, mask=offs < n_sel, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < s_kv)
        rows = kv_base + idx * skv_s
        kv_v = tl.load(rows[:, None] + dv[None, :], mask=valid[:, None] & vmask[None, :], other=0.0)
        if UPCAST:
            kv_v = kv_v.to(tl.float32)
        s = tl.dot(q_v, tl.trans(kv_v), input_precision=PRECISION)
        if HAS_TAIL:
            kv_t = tl.load(rows[:, None] + v_dim + dt[None, :], mask=valid[:, None] & tmask[None, :], other=0.0)
            if UPCAST:
                kv_t = kv_t.to(tl.float32)
            s += tl.dot(q_t, tl.trans(kv_t), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)
        # p is rounded to the input dtype for the tensor-core dot; under the interpreter it then goes back to
        # fp32 (UPCAST), keeping the rounding but avoiding the interpreter's bf16 dot.
        p_op = p.to(KV.dtype.element_ty)
        if UPCAST:
            p_op = p_op.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_op, kv_v, input_precision=PRECISION)
        m = m_new
    has = den > 0.0
    out = acc / tl.where(has, den, 1.0)[:, None]
    o_row = OUT + bat * so_b + tok * so_s + h_off * so_h
    tl.store(o_row + dv[None, :], out.to(OUT.dtype.element_ty), mask=hmask[:, None] & vmask[None, :])
    lse = tl.where(has, (m + tl.log2(tl.where(has, den, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(LSE + bat * sl_b + tok * sl_s + heads, lse, mask=hmask)


@kernel
def _sparse_mla_bwd(Q, KV, IDX, OUT, DO, LSE, DQ, DKV, P, DS,
                    sq_b, sq_s, sq_h, skv_b, skv_s, si_b, si_s, so_b, so_s, so_h, sdo_b, sdo_s, sdo_h,
                    sl_b, sl_s, sdq_b, sdq_s, sdq_h, sdk_b, sdk_s, sp_b, sp_s,
                    tok0, n_heads, s_kv, n_sel, v_dim, d_tail, qk_scale, sm_scale,
                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_T: tl.constexpr, HAS_TAIL: tl.constexpr, EVEN_V: tl.constexpr,
                    EVEN_T: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    WITH_DKV: tl.constexpr):
    # WITH_DKV=False is the split backward's dq pass: no dkv atomics; it stores the probabilities P and the
    # score gradients dS (times sm_scale) of tokens tok0.. into the [B, chunk, K, H] buffers for the dkv pass
    # (_sparse_mla_bwd_dkv) instead.
    # (head block, token) share grid axis 0: axis 1 is capped at 65535 (a 64K sequence overflows it), and the
    # head blocks of one token stay adjacent, so they read its gathered kv rows while those are in L2.
    n_hb = tl.cdiv(n_heads, BLOCK_H)
    hb, t_loc, bat = tl.program_id(0) % n_hb, (tl.program_id(0) // n_hb).to(tl.int64), tl.program_id(1).to(tl.int64)
    tok = tok0 + t_loc
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    # int64 before the head stride: a strided dout (einsum's backward gives [h, s, c] memory) has a head stride
    # of s * c, and 127 * 65536 * 512 overflows int32 (it did at 64K tokens: NaN in dq)
    h_off = heads.to(tl.int64)[:, None]
    dv = tl.arange(0, BLOCK_V)
    # With the part exactly as wide as its tile the channel mask is a compile-time constant, which lets Triton
    # prove 16-byte alignment and use vector loads and (in the backward) v4 atomics: 3x fewer atomic
    # instructions at V3.2's 512 + 64 (checked in the PTX).
    if EVEN_V:
        vmask = dv < BLOCK_V
    else:
        vmask = dv < v_dim
    hv_mask = hmask[:, None] & vmask[None, :]
    q_row = Q + bat * sq_b + tok * sq_s + h_off * sq_h
    q_v = tl.load(q_row + dv[None, :], mask=hv_mask, other=0.0)
    do = tl.load(DO + bat * sdo_b + tok * sdo_s + h_off * sdo_h + dv[None, :], mask=hv_mask, other=0.0)
    if UPCAST:
        q_v, do = q_v.to(tl.float32), do.to(tl.float32)
    o = tl.load(OUT + bat * so_b + tok * so_s + h_off * so_h + dv[None, :], mask=hv_mask, other=0.0)
    # delta = rowsum(dO * O): computed here rather than by a separate pass, it costs one extra [H, v] read.
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    lse = tl.load(LSE + bat * sl_b + tok * sl_s + heads, mask=hmask, other=float("-inf"))
    # Base-2 lse; a query (or padded head) without any valid key gets +inf so that its p is exactly 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dq_v = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    if HAS_TAIL:
        dt = tl.arange(0, BLOCK_T)
        if EVEN_T:
            tmask = dt < BLOCK_T
        else:
            tmask = dt < d_tail
        q_t = tl.load(q_row + v_dim + dt[None, :], mask=hmask[:, None] & tmask[None, :], other=0.0)
        if UPCAST:
            q_t = q_t.to(tl.float32)
        dq_t = tl.zeros([BLOCK_H, BLOCK_T], tl.float32)
    kv_base = KV + bat * skv_b
    dkv_base = DKV + bat * sdk_b
    idx_base = IDX + bat * si_b + tok * si_s
    pds_base = bat * sp_b + t_loc * sp_s + heads[:, None]  # the [K, H] slab of this token in the P/dS buffers
    for start in range(0, n_sel, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_base + offs, mask=offs < n_sel, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < s_kv)
        rows = kv_base + idx * skv_s
        kv_v = tl.load(rows[:, None] + dv[None, :], mask=valid[:, None] & vmask[None, :], other=0.0)
        if UPCAST:
            kv_v = kv_v.to(tl.float32)
        s = tl.dot(q_v, tl.trans(kv_v), input_precision=PRECISION)
        if HAS_TAIL:
            kv_t = tl.load(rows[:, None] + v_dim + dt[None, :], mask=valid[:, None] & tmask[None, :], other=0.0)
            if UPCAST:
                kv_t = kv_t.to(tl.float32)
            s += tl.dot(q_t, tl.trans(kv_t), input_precision=PRECISION)
        p = tl.where(valid[None, :], tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(kv_v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])  # d(loss)/d(q.k) up to sm_scale
        if not WITH_DKV:  # the dkv pass reads dS with sm_scale in it, so dq takes it the same way
            ds = ds * sm_scale
        ds = ds.to(KV.dtype.element_ty)
        p_op = p.to(KV.dtype.element_ty)
        if not WITH_DKV:
            pds = pds_base + offs.to(tl.int64)[None, :] * n_heads
            pds_mask = hmask[:, None] & (offs < n_sel)[None, :]
            tl.store(P + pds, p_op, mask=pds_mask)
            tl.store(DS + pds, ds, mask=pds_mask)
        if UPCAST:
            ds, p_op = ds.to(tl.float32), p_op.to(tl.float32)
        dq_v += tl.dot(ds, kv_v, input_precision=PRECISION)
        if HAS_TAIL:
            dq_t += tl.dot(ds, kv_t, input_precision=PRECISION)
        if WITH_DKV:
            # dkv for the value part: dk (sm_scale * ds^T q) plus dv (p^T dO), both [BLOCK_N, v].
            dkv_v = tl.dot(tl.trans(ds), q_v, input_precision=PRECISION) * sm_scale
            dkv_v += tl.dot(tl.trans(p_op), do, input_precision=PRECISION)
            d_rows = dkv_base + idx * sdk_s
            tl.atomic_add(d_rows[:, None] + dv[None, :], dkv_v, mask=valid[:, None] & vmask[None, :],
                          sem="relaxed")
            if HAS_TAIL:
                dkv_t = tl.dot(tl.trans(ds), q_t, input_precision=PRECISION) * sm_scale
                tl.atomic_add(d_rows[:, None] + v_dim + dt[None, :], dkv_t, mask=valid[:, None] & tmask[None, :],
                              sem="relaxed")
    if WITH_DKV:
        dq_v *= sm_scale
        if HAS_TAIL:
            dq_t *= sm_scale
    dq_row = DQ + bat * sdq_b + tok * sdq_s + h_off * sdq_h
    tl.store(dq_row + dv[None, :], dq_v.to(DQ.dtype.element_ty), mask=hv_mask)
    if HAS_TAIL:
        tl.store(dq_row + v_dim + dt[None, :], dq_t.to(DQ.dtype.element_ty), mask=hmask[:, None] & tmask[None, :])


@kernel
def _sparse_mla_bwd_dkv(Q, DO, IDX, P, DS, DKV,
                        sq_b, sq_s, sq_h, si_b, si_s, sdo_b, sdo_s, sdo_h, sp_b, sp_s, sdk_b, sdk_s,
                        tok0, n_heads, s_kv, n_sel, v_dim, d_tail,
                        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                        BLOCK_T: tl.constexpr, HAS_TAIL: tl.constexpr, EVEN_V: tl.constexpr,
                        EVEN_T: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # The split backward's dkv pass: one program per (key tile, token) of tokens tok0.. . It reads the tile's
    # P and dS rows [BLOCK_N, H] that the dq pass stored, and adds dS^T q + P^T dO, summed over every head of
    # the token (the heads are the dots' reduction axis, BLOCK_H at a time), with one atomic add per tile.
    n_tiles = tl.cdiv(n_sel, BLOCK_N)
    tile, t_loc, bat = tl.program_id(0) % n_tiles, (tl.program_id(0) // n_tiles).to(tl.int64), tl.program_id(1).to(tl.int64)
    tok = tok0 + t_loc
    dv = tl.arange(0, BLOCK_V)
    if EVEN_V:
        vmask = dv < BLOCK_V
    else:
        vmask = dv < v_dim
    offs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = offs < n_sel
    idx = tl.load(IDX + bat * si_b + tok * si_s + offs, mask=kmask, other=-1).to(tl.int64)
    valid = (idx >= 0) & (idx < s_kv)
    pds_rows = bat * sp_b + t_loc * sp_s + offs.to(tl.int64)[:, None] * n_heads
    acc_v = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    if HAS_TAIL:
        dt = tl.arange(0, BLOCK_T)
        if EVEN_T:
            tmask = dt < BLOCK_T
        else:
            tmask = dt < d_tail
        acc_t = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        hmask = heads < n_heads
        h_off = heads.to(tl.int64)[:, None]
        p_t = tl.load(P + pds_rows + heads[None, :], mask=kmask[:, None] & hmask[None, :], other=0.0)
        ds_t = tl.load(DS + pds_rows + heads[None, :], mask=kmask[:, None] & hmask[None, :], other=0.0)
        q_row = Q + bat * sq_b + tok * sq_s + h_off * sq_h
        hv_mask = hmask[:, None] & vmask[None, :]
        q_v = tl.load(q_row + dv[None, :], mask=hv_mask, other=0.0)
        do = tl.load(DO + bat * sdo_b + tok * sdo_s + h_off * sdo_h + dv[None, :], mask=hv_mask, other=0.0)
        if UPCAST:
            p_t, ds_t, q_v, do = p_t.to(tl.float32), ds_t.to(tl.float32), q_v.to(tl.float32), do.to(tl.float32)
        acc_v += tl.dot(ds_t, q_v, input_precision=PRECISION)
        acc_v += tl.dot(p_t, do, input_precision=PRECISION)
        if HAS_TAIL:
            q_t = tl.load(q_row + v_dim + dt[None, :], mask=hmask[:, None] & tmask[None, :], other=0.0)
            if UPCAST:
                q_t = q_t.to(tl.float32)
            acc_t += tl.dot(ds_t, q_t, input_precision=PRECISION)
    d_rows = DKV + bat * sdk_b + idx * sdk_s
    tl.atomic_add(d_rows[:, None] + dv[None, :], acc_v, mask=valid[:, None] & vmask[None, :], sem="relaxed")
    if HAS_TAIL:
        tl.atomic_add(d_rows[:, None] + v_dim + dt[None, :], acc_t, mask=valid[:, None] & tmask[None, :],
                      sem="relaxed")


def why_not(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, v_dim: int) -> str | None:
    """The reason the Triton kernel cannot take these inputs, or None."""
    if next_pow2(v_dim) > _MAX_DIM or next_pow2(max(q.shape[-1] - v_dim, 1)) > _MAX_DIM:
        return f"D_qk={q.shape[-1]}, v_dim={v_dim} is over the kernel's limit ({_MAX_DIM} per part)"
    return None


def _dims(d: int, v_dim: int) -> dict[str, int | bool]:
    tail = d - v_dim
    # tl.dot needs every dimension >= 16, hence the floors.
    block_v, block_t = max(16, next_pow2(v_dim)), max(16, next_pow2(max(tail, 1)))
    return {"BLOCK_V": block_v, "BLOCK_T": block_t, "HAS_TAIL": tail > 0,
            "EVEN_V": block_v == v_dim, "EVEN_T": block_t == tail}


def _block_h(n_heads: int, cap: int) -> int:
    return max(16, min(cap, next_pow2(n_heads)))


def _upcast(t: torch.Tensor) -> bool:
    """Triton's interpreter multiplies bf16 dot operands as their raw uint16 bits; give it fp32 instead."""
    return t.dtype == torch.bfloat16 and interpreting()


def _inner(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _SparseMLAFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, softmax_scale, v_dim):
        q, kv, indices = _inner(q), _inner(kv), _inner(indices)
        b, s, h, d = q.shape
        out = torch.empty((b, s, h, v_dim), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, s, h), dtype=torch.float32, device=q.device)
        cfg = dict(FWD_CONFIG)
        block_h = _block_h(h, cfg.pop("BLOCK_H"))
        prec = "ieee" if q.dtype == torch.float32 else "tf32"
        if b and s and h:
            _sparse_mla_fwd[(cdiv(h, block_h) * s, b)](
                q, kv, indices, out, lse,
                q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
                indices.stride(0), indices.stride(1), out.stride(0), out.stride(1), out.stride(2),
                lse.stride(0), lse.stride(1),
                h, kv.shape[1], indices.shape[2], v_dim, d - v_dim, softmax_scale * _LOG2E,
                BLOCK_H=block_h, PRECISION=prec, UPCAST=_upcast(q), **_dims(d, v_dim), **cfg)
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.softmax_scale, ctx.v_dim = softmax_scale, v_dim
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv, indices, out, lse = ctx.saved_tensors
        v_dim, scale = ctx.v_dim, ctx.softmax_scale
        b, s, h, d = q.shape
        if dout is None:
            return torch.zeros_like(q), torch.zeros_like(kv), None, None, None
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        dout = _inner(dout)
        cfg = dict(BWD_CONFIG)
        block_h = _block_h(h, cfg.pop("BLOCK_H"))
        prec = "ieee" if q.dtype == torch.float32 else "tf32"
        common = dict(PRECISION=prec, UPCAST=_upcast(q), **_dims(d, v_dim))
        n_sel = indices.shape[2]
        if not (b and s and h and n_sel):
            return dq, dkv.to(kv.dtype), None, None, None
        bwd_args = (q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
                    indices.stride(0), indices.stride(1), out.stride(0), out.stride(1), out.stride(2),
                    dout.stride(0), dout.stride(1), dout.stride(2), lse.stride(0), lse.stride(1),
                    dq.stride(0), dq.stride(1), dq.stride(2), dkv.stride(0), dkv.stride(1))
        if not BWD_SPLIT:  # lse stands in for the P/dS buffers, which the fused kernel does not touch
            _sparse_mla_bwd[(cdiv(h, block_h) * s, b)](
                q, kv, indices, out, dout, lse, dq, dkv, lse, lse, *bwd_args, 0, 0,
                0, h, kv.shape[1], n_sel, v_dim, d - v_dim, scale * _LOG2E, scale,
                BLOCK_H=block_h, WITH_DKV=True, **common, **cfg)
            return dq, dkv.to(kv.dtype), None, None, None
        # The split backward walks the sequence in chunks of tokens whose P and dS fit SPLIT_BUFFER_BYTES.
        chunk = max(1, min(s, SPLIT_BUFFER_BYTES // (2 * b * n_sel * h * q.element_size())))
        probs = torch.empty((b, chunk, n_sel, h), dtype=q.dtype, device=q.device)
        dscores = torch.empty_like(probs)
        qcfg, dcfg = dict(DQ_CONFIG), dict(DKV_CONFIG)
        if q.element_size() > 2:
            # fp32 tiles take twice the shared memory: the dq pass at 64/64 asked 303104 B of the H200's 232448
            # (test_sparse_mla_fp32_matches_reference[split-bwd]); the fused backward's 32/32, one stage, holds a
            # dq and a dkv tile in fp32, so each pass alone fits in it
            small = {"BLOCK_H": BWD_CONFIG["BLOCK_H"], "BLOCK_N": BWD_CONFIG["BLOCK_N"], "num_stages": 1}
            qcfg.update(small)
            dcfg.update(small)
        dq_block_h, dkv_block_h = _block_h(h, qcfg.pop("BLOCK_H")), _block_h(h, dcfg.pop("BLOCK_H"))
        for tok0 in range(0, s, chunk):
            n = min(chunk, s - tok0)
            _sparse_mla_bwd[(cdiv(h, dq_block_h) * n, b)](
                q, kv, indices, out, dout, lse, dq, dkv, probs, dscores, *bwd_args, probs.stride(0),
                probs.stride(1), tok0, h, kv.shape[1], n_sel, v_dim, d - v_dim, scale * _LOG2E, scale,
                BLOCK_H=dq_block_h, WITH_DKV=False, **common, **qcfg)
            _sparse_mla_bwd_dkv[(cdiv(n_sel, dcfg["BLOCK_N"]) * n, b)](
                q, dout, indices, probs, dscores, dkv,
                q.stride(0), q.stride(1), q.stride(2), indices.stride(0), indices.stride(1),
                dout.stride(0), dout.stride(1), dout.stride(2), probs.stride(0), probs.stride(1),
                dkv.stride(0), dkv.stride(1), tok0, h, kv.shape[1], n_sel, v_dim, d - v_dim,
                BLOCK_H=dkv_block_h, **common, **dcfg)
        return dq, dkv.to(kv.dtype), None, None, None


def sparse_mla_attention_triton(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *,
                                softmax_scale: float, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of :func:`loong.kernels.dsa.sparse_mla_attention` (inputs already checked)."""
    return _SparseMLAFn.apply(q, kv, indices, float(softmax_scale), int(v_dim))
