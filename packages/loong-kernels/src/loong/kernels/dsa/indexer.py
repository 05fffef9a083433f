"""Triton lightning-indexer top-k: scores in bounded key chunks, a running top-k per query, no S x S matrix.

Each program owns one query row at a time (a persistent grid walks the rows with a stride, which spreads
the causal triangle's uneven rows evenly). For a row it:

1. loads the query's ``H_I`` heads ``[H_I, D_I]`` and weights once;
2. walks the eligible keys in chunks of ``KP = next_pow2(topk)``; each chunk's scores are computed in
   ``BLOCK_N``-key slices with one ``tl.dot`` per slice (``[H_I, D_I] x [D_I, BLOCK_N]``, then ReLU,
   the weights and a sum over heads) and written to the program's own ``KP``-entry scratch row, which
   stays in L1/L2 (registers cannot be concatenated, so this is how the slices become one chunk);
3. merges the chunk into the running top-k: the chunk is sorted ascending, the elementwise maximum with
   the (descending) running list is a bitonic sequence holding the top ``KP`` of both, and one bitonic
   merge sorts it again. A chunk whose best score cannot beat the current ``KP``-th is skipped.

Scores and key positions travel together as one int64: the high 32 bits are the fp32 score's bits mapped
to an order-preserving signed integer, the low 32 the key position, so sorting the int64 sorts by score
(ties by position) and carries the index along. Masked keys get the smallest int64 and decode to -1.
Memory is ``O(grid * KP)`` scratch plus the ``[B, S, topk]`` output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from loong.kernels._dispatch import interpreting, kernel, next_pow2, num_programs

try:
    import triton.language as tl
except ImportError:  # pragma: no cover
    tl = None

_MAX_TOPK = 8192  # the running list lives in registers: KP int64 per program
_MAX_HEADS = 128
_MAX_DIM = 256
# (BLOCK_N, num_warps, programs per SM). Overridable for tuning (benchmarks/dsa.py --indexer-config).
INDEXER_CONFIG: dict[str, int] = {"BLOCK_N": 128, "num_warps": 8, "per_sm": 4}


@kernel
def _indexer_topk_kernel(Q, K, W, OUT, SCRATCH,
                         sq_b, sq_s, sq_h, sk_b, sk_s, sw_b, sw_s, sw_h, so_b, so_s,
                         n_rows, seq, seq_k, n_heads, d, topk, scale, n_prog,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         KP: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                         UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < d
    slot = tl.arange(0, KP)
    sub = tl.arange(0, BLOCK_N)
    scratch = SCRATCH + pid.to(tl.int64) * KP
    # -2**63: below every packed finite score (only a negative NaN maps to the same high word).
    sentinel = tl.full([KP], -2147483648, tl.int64) << 32
    for row in range(pid, n_rows, n_prog):
        bat = (row // seq).to(tl.int64)
        tok = row % seq
        q = tl.load(Q + bat * sq_b + tok.to(tl.int64) * sq_s + heads.to(tl.int64)[:, None] * sq_h + dims[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 dot operands as raw uint16 bits
            q = q.to(tl.float32)
        w = tl.load(W + bat * sw_b + tok.to(tl.int64) * sw_s + heads.to(tl.int64) * sw_h, mask=hmask, other=0.0).to(tl.float32)
        if CAUSAL:  # the queries are the last seq of seq_k positions
            n_keys = tok + 1 + (seq_k - seq)
        else:
            n_keys = seq_k
        best = sentinel
        for c0 in range(0, n_keys, KP):
            for j in range(0, KP, BLOCK_N):
                keys = c0 + j + sub
                kmask = keys < n_keys
                kt = tl.load(K + bat * sk_b + keys.to(tl.int64)[:, None] * sk_s + dims[None, :],
                             mask=kmask[:, None] & dmask[None, :], other=0.0)
                if UPCAST:
                    kt = kt.to(tl.float32)
                logits = tl.dot(q, tl.trans(kt), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
                score = tl.sum(tl.maximum(logits * scale, 0.0) * w[:, None], 0)
                bits = score.to(tl.int32, bitcast=True)
                ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order == signed int order
                packed = (ordered.to(tl.int64) << 32) | keys.to(tl.int64)
                packed = tl.where(kmask, packed, tl.full([BLOCK_N], -2147483648, tl.int64) << 32)
                tl.store(scratch + j + sub, packed)
            tl.debug_barrier()  # the slices were stored by other threads of this program
            chunk = tl.load(scratch + slot)
            tl.debug_barrier()  # everyone has read the chunk before the next one overwrites it
            if tl.max(chunk, 0) > tl.min(best, 0):
                chunk = tl.sort(chunk)
                best = tl.bitonic_merge(tl.maximum(best, chunk), descending=True)
        idx = tl.where(best != sentinel, (best & 0xFFFFFFFF).to(tl.int32), -1)
        tl.store(OUT + bat * so_b + tok.to(tl.int64) * so_s + slot, idx, mask=slot < topk)


@contextlib.contextmanager
def _patch_language_once() -> Iterator[None]:
    """Under the interpreter, patch ``triton.language`` once per launch rather than once per helper call.

    The interpreter re-patches every ``triton.language`` builtin (``inspect.getmembers`` over the modules)
    at each call of a ``@jit`` helper, and ``tl.sort``/``tl.bitonic_merge`` make hundreds of such calls per
    merge: that was 60% of this kernel's interpreted time. The patch is the same every time and the
    launch's own patch stays in force until the launch ends, so repeating it changes nothing.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    done: set[int] = set()

    def once(fn):
        key = id(fn.__globals__)
        if key not in done:
            done.add(key)
            return original(fn)
        return None

    interpreter._patch_lang = once
    try:
        yield
    finally:
        interpreter._patch_lang = original


def why_not(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int) -> str | None:
    """The reason the Triton kernel cannot take these inputs, or None."""
    if k.dtype != q.dtype:
        return f"k has dtype {k.dtype} but q has {q.dtype}; the kernel takes them in one dtype"
    if next_pow2(topk) > _MAX_TOPK:
        return f"topk={topk} is over the kernel's limit ({_MAX_TOPK})"
    if q.shape[2] > _MAX_HEADS or q.shape[3] > _MAX_DIM:
        return f"H_I={q.shape[2]}, D_I={q.shape[3]} is over the kernel's limit ({_MAX_HEADS} heads of {_MAX_DIM})"
    if k.shape[1] >= 2**31:
        return "sequence too long for 32-bit key positions"
    return None


def indexer_topk_triton(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *,
                        scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """The Triton path of :func:`loong.kernels.dsa.indexer_topk` (inputs already checked)."""
    b, s, h, d = q.shape
    scale = d ** -0.5 if scale is None else float(scale)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    out = torch.empty((b, s, topk), dtype=torch.int32, device=q.device)
    kp = max(16, next_pow2(topk))
    cfg = dict(INDEXER_CONFIG)
    block_n = min(cfg.pop("BLOCK_N"), kp)
    per_sm = cfg.pop("per_sm")
    rows = b * s
    if rows == 0:
        return out
    n_prog = min(rows, num_programs(q.device) * per_sm)
    scratch = torch.empty((n_prog, kp), dtype=torch.int64, device=q.device)
    ctx = _patch_language_once() if interpreting() else contextlib.nullcontext()
    with ctx:
        _indexer_topk_kernel[(n_prog,)](
            q, k, weights, out, scratch,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0), out.stride(1),
            rows, s, k.shape[1], h, d, topk, scale, n_prog,
            BLOCK_H=max(16, next_pow2(h)), BLOCK_D=max(16, next_pow2(d)), BLOCK_N=block_n, KP=kp,
            CAUSAL=bool(causal), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=q.dtype == torch.bfloat16 and interpreting(), **cfg)
    return out
