"""Fused linear + cross-entropy: the loss of ``hidden @ weight.T`` without the full logits tensor.

The eager form materialises ``[tokens, vocab]`` logits, an fp32 copy, the log-softmax and its gradient:
for 16K tokens and a 128K vocabulary that is 4 GB per bf16 copy and 8 GB per fp32 one. Here the tokens
are walked in chunks; for each chunk

1. ``logits = hidden_c @ weight.T`` (cuBLAS, bf16 in, fp32 accumulation, ``[c, V]`` in the input dtype),
2. one Triton program per row computes the log-sum-exp online in fp32, the loss, and overwrites the
   logits with their gradient ``(softmax - onehot) * scale`` (plus the z-loss term),
3. ``grad_hidden_c = dlogits @ weight`` and ``grad_weight += dlogits.T @ hidden_c``, the latter
   accumulated across chunks in an fp32 buffer (cuBLAS writes fp32 straight from bf16 operands), or in the
   weight's dtype with ``fp32_accumulate=False`` (Liger-Kernel's choice: half the memory, one bf16
   rounding per chunk).

So the gradients are finished during the forward pass (one logits GEMM instead of two) and backward
only scales them, in place, by the incoming gradient (so backward runs once: a retained graph cannot
run it again). Chunks are large by default (about 1 GiB of logits) because the ``grad_weight``
accumulation reads and writes ``V x H`` once per chunk: with small chunks that traffic, not the matrix
products, sets the time.

``reduction="none"`` returns the per-token losses, which megatron-core's models hand to the task's loss
function (``losses * loss_mask``). The gradients are still made in forward, for an incoming gradient of 1 per
token; backward scales each row of the hidden gradient by its token's incoming gradient (exact for any
weights), and the weight gradient by the common value when every counted token has the same one (a plain
mean or sum over them: one host sync to check). Otherwise it recomputes the weight gradient with the
per-token weights (one more logits GEMM per chunk), so the result is exact either way.

``fp8=True`` runs two of each chunk's three GEMMs in FP8 (tensorwise scales, the recipe of ``precision.fp8=
tensorwise``): the logits from e4m3 hidden states and weight, each quantised once per call, and the hidden gradient
from the e5m2-quantised logit gradient (one scale per chunk) and the e4m3 weight, transposed once. The weight
gradient stays a bf16 GEMM accumulating in fp32: ``torch._scaled_mm`` cannot accumulate into an fp32 buffer, and
its transposed fp8 operands would cost two more passes per chunk. For the output layer of large vocabularies, where
those GEMMs are a fifth of an FP8 step (docs/performance.md); off by default, as every FP8 recipe of the field
keeps the output layer in high precision.

Vocabulary-parallel (tensor-parallel) logits are not handled: the log-sum-exp would need an all-reduce
across ranks. Use it with the output layer unsharded (TP = 1) or fall back to the reference.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from loong.kernels._dispatch import Backend, cdiv, check_float, kernel, use_triton
from loong.kernels.fp8 import quantize_tensorwise, transpose_2d
from loong.kernels.gemm import mm_accumulate

try:
    import triton.language as tl
except ImportError:  # pragma: no cover
    tl = None

Reduction = Literal["mean", "sum", "none"]
LOGITS_BUDGET_BYTES = 1 << 30  # default chunk: about this many bytes of logits at a time
_BLOCK_V = 4096


@kernel
def _ce_rows(LOGITS, LABELS, LOSS, SCALE, stride_scale, n_cols, stride_l, ignore_index, z_loss,
             WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_l
    label = tl.load(LABELS + row)
    valid = label != ignore_index
    # pass 1: online max and sum of exponentials, in fp32
    m = -float("inf")
    d = 0.0
    for off in range(0, n_cols, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)
    safe_label = tl.where(valid, label, 0)
    x_label = tl.load(ptr + safe_label).to(tl.float32)
    loss = lse - x_label + z_loss * lse * lse
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    if WRITE_GRAD:
        # d/dx [lse + z lse^2 - x_label] = softmax * (1 + 2 z lse) - onehot; ignored rows get zeros
        # SCALE is one value (stride 0) or one per row (the per-token weights of reduction="none")
        scale = tl.load(SCALE + row * stride_scale).to(tl.float32) * tl.where(valid, 1.0, 0.0)
        pscale = (1.0 + 2.0 * z_loss * lse) * scale
        for off in range(0, n_cols, BLOCK_V):
            cols = off + tl.arange(0, BLOCK_V)
            cmask = cols < n_cols
            x = tl.load(ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * pscale - tl.where(cols == label, scale, 0.0)
            tl.store(ptr + cols, g.to(LOGITS.dtype.element_ty), mask=cmask)


@kernel
def _scale_cast(SRC, DST, G, n, BLOCK: tl.constexpr):
    """``DST = SRC * G[0]`` in DST's dtype: the fp32 weight gradient times the incoming gradient."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G).to(tl.float32)
    tl.store(DST + offs, (tl.load(SRC + offs, mask=mask, other=0.0) * g).to(DST.dtype.element_ty), mask=mask)


@kernel
def _scale_rows(X, G, n, n_cols, BLOCK: tl.constexpr):
    """``X[i, :] *= G[i]`` in fp32, in place: the per-token incoming gradient on the hidden gradient."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs // n_cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(X + offs, (x * g).to(X.dtype.element_ty), mask=mask)


def _chunk_rows(n_tokens: int, vocab: int, itemsize: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size <= 0:
            raise ValueError(f"fused_linear_cross_entropy: chunk_size must be positive, got {chunk_size}")
        return min(chunk_size, max(n_tokens, 1))
    rows = max(128, LOGITS_BUDGET_BYTES // (vocab * itemsize) // 128 * 128)
    return min(rows, max(n_tokens, 1))


class _FP8Operands:
    """The e4m3 operands of an FP8 chunk walk, quantised once per call: hidden states ``[n, H]``, the weight
    ``[V, H]`` and (for the hidden gradient) its transpose ``[H, V]``, each with its tensorwise scale."""

    def __init__(self, h2: torch.Tensor, weight: torch.Tensor, need_dh: bool) -> None:
        self.hq, self.hs = quantize_tensorwise(h2, backend="triton")
        self.wq, self.ws = quantize_tensorwise(weight, backend="triton")
        # a transposed tensorwise-quantised tensor is the quantised transpose, bit for bit
        self.wqt = transpose_2d(self.wq, backend="triton") if need_dh else None

    def logits(self, start: int, end: int, out: torch.Tensor) -> None:
        torch._scaled_mm(self.hq[start:end], self.wq.t(), self.hs, self.ws, out_dtype=out.dtype, out=out)

    def hidden_grad(self, dlogits: torch.Tensor, out: torch.Tensor) -> None:
        gq, gs = quantize_tensorwise(dlogits, fp8_dtype=torch.float8_e5m2, backend="triton")
        torch._scaled_mm(gq, self.wqt.t(), gs, self.ws, out_dtype=out.dtype, out=out)


def fp8_unsupported(hidden_size: int, vocab: int) -> str | None:
    """Why ``fp8=True`` cannot take an output layer of ``vocab x hidden_size`` (None: it can): ``torch._scaled_mm``
    needs both GEMMs' contraction and output dimensions to be multiples of 16."""
    bad = [f"{name} {v}" for name, v in (("hidden size", hidden_size), ("vocabulary", vocab)) if v % 16]
    if not bad:
        return None
    return f"{' and '.join(bad)} {'is not a multiple' if len(bad) == 1 else 'are not multiples'} of 16 (torch._scaled_mm)"


def _chunks(h2: torch.Tensor, weight: torch.Tensor, lab: torch.Tensor, losses: torch.Tensor, scale: torch.Tensor,
            ignore_index: int, z_loss: float, chunk_size: int | None, dh: torch.Tensor | None,
            dw: torch.Tensor | None, write_grad: bool, per_row: bool = False, fp8: bool = False) -> None:
    """The chunk walk: logits GEMM, the row kernel (loss, and the logit gradient in place), then the hidden
    gradient into ``dh`` and the weight gradient accumulated into ``dw`` (either may be None).

    ``scale`` is ``[1]``, one factor for every row, or with ``per_row`` ``[n]``, one per row. ``fp8``: the logits
    and hidden-gradient GEMMs in FP8 (:class:`_FP8Operands`).
    """
    n, vocab = h2.shape[0], weight.shape[0]
    rows = _chunk_rows(n, vocab, h2.element_size(), chunk_size)
    logits_buf = torch.empty((min(rows, n), vocab), dtype=h2.dtype, device=h2.device) if n else None
    warps = 8 if h2.is_cuda else 4
    fp8_ops = _FP8Operands(h2, weight, dh is not None) if fp8 and n else None
    for i, start in enumerate(range(0, n, rows)):
        end = min(start + rows, n)
        hc = h2[start:end]
        lg = logits_buf[: end - start]
        if fp8_ops is not None:
            fp8_ops.logits(start, end, lg)
        else:
            torch.mm(hc, weight.t(), out=lg)
        sc = scale[start:end] if per_row else scale
        _ce_rows[(end - start,)](lg, lab[start:end], losses[start:end], sc, 1 if per_row else 0, vocab,
                                 lg.stride(0), ignore_index, z_loss, WRITE_GRAD=write_grad, BLOCK_V=_BLOCK_V,
                                 num_warps=warps)
        if dh is not None and fp8_ops is not None:
            fp8_ops.hidden_grad(lg, dh[start:end])
        elif dh is not None:
            torch.mm(lg, weight, out=dh[start:end])
        if dw is not None:
            mm_accumulate(dw, lg.t(), hc, beta=0.0 if i == 0 else 1.0)
    if dw is not None and n == 0:
        dw.zero_()


def _scaled_weight_grad(dw: torch.Tensor, g: torch.Tensor, wdtype: torch.dtype) -> torch.Tensor:
    """``dw * g`` (``g`` a one-element device tensor) in ``wdtype``; in place when ``dw`` already has it."""
    out = dw if dw.dtype == wdtype else torch.empty(dw.shape, dtype=wdtype, device=dw.device)
    if dw.numel():
        block = 4096
        _scale_cast[(cdiv(dw.numel(), block),)](dw, out, g, dw.numel(), BLOCK=block, num_warps=8)
    return out


class _FusedLinearCEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, z_loss, reduction, chunk_size, fp32_accumulate, need_dh,
                need_dw, fp8):
        h2 = hidden.reshape(-1, hidden.shape[-1])
        if h2.stride(-1) != 1:
            h2 = h2.contiguous()
        lab = labels.reshape(-1)
        n, hid = h2.shape
        vocab = weight.shape[0]
        dev = h2.device
        valid = lab != ignore_index
        # garbage labels would index outside the row: refuse them here (one host sync per call)
        if bool((valid & ((lab < 0) | (lab >= vocab))).any()):
            raise ValueError(f"fused_linear_cross_entropy: labels outside [0, {vocab}) that are not "
                             f"ignore_index={ignore_index}")
        if reduction == "mean":
            scale = 1.0 / valid.sum().clamp(min=1).to(torch.float32)  # stays on the device: no sync
        else:  # "sum", and "none" (gradients for an incoming gradient of 1 per token, rescaled in backward)
            scale = torch.ones((), dtype=torch.float32, device=dev)
        scale = scale.reshape(1)
        losses = torch.empty(n, dtype=torch.float32, device=dev)
        dh = torch.empty_like(h2) if need_dh else None
        acc_dtype = torch.float32 if fp32_accumulate else weight.dtype
        dw = torch.empty((vocab, hid), dtype=acc_dtype, device=dev) if need_dw else None
        _chunks(h2, weight, lab, losses, scale, ignore_index, z_loss, chunk_size, dh, dw, need_dh or need_dw,
                fp8=fp8)
        # the buffers, not saved tensors: backward scales them in place and hands them out as the gradients
        ctx.grads = (dh, dw)
        ctx.shape, ctx.wdtype, ctx.reduction = hidden.shape, weight.dtype, reduction
        if reduction == "none":
            # for the weight gradient under unequal per-token weights (recomputed in backward)
            ctx.recompute = (h2, weight, lab, valid, ignore_index, z_loss, chunk_size, acc_dtype, fp8) if need_dw \
                else None
            return losses.view(labels.shape)
        return (losses.sum() * scale[0]) if n else torch.zeros((), dtype=torch.float32, device=dev)

    @staticmethod
    def backward(ctx, g):
        if ctx.grads is None:
            raise RuntimeError("fused_linear_cross_entropy: backward ran twice; its gradients are computed in "
                               "forward and handed out once (do not retain this graph for a second backward)")
        dh, dw = ctx.grads
        ctx.grads = None
        if ctx.reduction == "none":
            grad_h, grad_w = _FusedLinearCEFn._per_token_backward(ctx, dh, dw, g)
            return grad_h, grad_w, None, None, None, None, None, None, None, None, None
        g = g.to(torch.float32).reshape(1)
        grad_h = grad_w = None
        block = 4096
        if dh is not None:
            if dh.numel():
                _scale_cast[(cdiv(dh.numel(), block),)](dh, dh, g, dh.numel(), BLOCK=block, num_warps=8)
            grad_h = dh.view(ctx.shape)
        if dw is not None:
            # fp32 accumulator -> a new tensor in the weight's dtype; same dtype -> scaled in place
            grad_w = _scaled_weight_grad(dw, g, ctx.wdtype)
        return grad_h, grad_w, None, None, None, None, None, None, None, None, None

    @staticmethod
    def _per_token_backward(ctx, dh, dw, g):
        g = g.reshape(-1).to(torch.float32).contiguous()
        grad_h = grad_w = None
        if dh is not None:
            if dh.numel():
                block = 4096
                _scale_rows[(cdiv(dh.numel(), block),)](dh, g, dh.numel(), dh.shape[1], BLOCK=block, num_warps=8)
            grad_h = dh.view(ctx.shape)
        if dw is not None:
            h2, weight, lab, valid, ignore_index, z_loss, chunk_size, acc_dtype, fp8 = ctx.recompute
            ctx.recompute = None
            inf = torch.full((), float("inf"), device=g.device)
            hi = torch.where(valid, g, -inf).amax() if g.numel() else -inf
            lo = torch.where(valid, g, inf).amin() if g.numel() else inf
            counted = valid.any()
            if bool((lo == hi) | ~counted):  # the one host sync of backward
                # every counted token has the same weight: the forward's weight gradient, scaled once
                grad_w = _scaled_weight_grad(dw, torch.where(counted, hi, 0.0).reshape(1), ctx.wdtype)
            else:
                # unequal weights (e.g. a loss mask the labels do not carry): redo the chunk walk with them
                scratch = torch.empty(h2.shape[0], dtype=torch.float32, device=h2.device)
                # the same logits as forward's (fp8 included): the weight gradient of the loss that was computed
                _chunks(h2, weight, lab, scratch, g, ignore_index, z_loss, chunk_size, None, dw, True, per_row=True,
                        fp8=fp8)
                grad_w = dw if dw.dtype == ctx.wdtype else dw.to(ctx.wdtype)
        return grad_h, grad_w


def _check(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str) -> None:
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"fused_linear_cross_entropy: weight {tuple(weight.shape)} is not [vocab, "
                         f"{hidden.shape[-1]}]")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"fused_linear_cross_entropy: labels {tuple(labels.shape)} must match hidden's leading "
                         f"dimensions {tuple(hidden.shape[:-1])} (megatron: pass labels.t() for [s, b, h] hidden)")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"fused_linear_cross_entropy: labels must be int64/int32, got {labels.dtype}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"fused_linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def fused_linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                         ignore_index: int = -100, z_loss: float = 0.0,
                                         reduction: Reduction = "mean", chunk_size: int | None = None,
                                         fp32_accumulate: bool = True) -> torch.Tensor:
    """Eager twin of :func:`fused_linear_cross_entropy`: full logits, upcast to fp32 (``chunk_size`` and
    ``fp32_accumulate`` are accepted and unused: there is one GEMM, accumulating in fp32)."""
    _check(hidden, weight, labels, reduction)
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()).float()
    lab = labels.reshape(-1).long()
    valid = lab != ignore_index
    if reduction == "none":  # per token, 0 where ignored (as F.cross_entropy gives)
        losses = F.cross_entropy(logits, lab, ignore_index=ignore_index, reduction="none")
        if z_loss:
            losses = losses + z_loss * torch.logsumexp(logits, dim=-1).square() * valid
        return losses.view(labels.shape)
    total = F.cross_entropy(logits, lab, ignore_index=ignore_index, reduction="sum")
    if z_loss:
        lse = torch.logsumexp(logits, dim=-1)
        total = total + z_loss * (lse.square() * valid).sum()
    if reduction == "mean":
        total = total / valid.sum().clamp(min=1)
    return total


def _why_not(hidden: torch.Tensor, weight: torch.Tensor) -> str | None:
    reason = check_float("fused_linear_cross_entropy", hidden, "hidden") or check_float(
        "fused_linear_cross_entropy", weight, "weight")
    if reason:
        return reason
    if hidden.dtype != weight.dtype:
        return f"hidden is {hidden.dtype} but weight is {weight.dtype}"
    if weight.stride(-1) != 1 and weight.stride(0) != 1:
        return "weight is neither row- nor column-major"
    return None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, z_loss: float = 0.0, reduction: Reduction = "mean",
                               chunk_size: int | None = None, fp32_accumulate: bool = True, *,
                               backend: Backend = "auto", fp8: bool = False) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels``, never holding all the logits.

    ``loss = reduce_i [lse_i - logit_i[label_i] + z_loss * lse_i^2]`` over tokens whose label is not
    ``ignore_index``; ``"mean"`` divides by the number of such tokens (0 tokens give a loss of 0 and zero
    gradients, where ``torch.nn.functional.cross_entropy`` would give NaN).

    Args:
        hidden: ``[..., H]`` final hidden states, bf16/fp16/fp32 (megatron's ``[s, b, H]`` works as is).
        weight: ``[V, H]`` output projection (the tied embedding or the LM head), same dtype as ``hidden``.
        labels: int64/int32 with ``hidden``'s leading shape (for megatron's ``[b, s]`` labels pass
            ``labels.t()``).
        ignore_index: label of tokens that carry no loss.
        z_loss: coefficient of the ``lse^2`` auxiliary loss (PaLM's z-loss); 0 disables it.
        reduction: ``"mean"``, ``"sum"``, or ``"none"`` for the per-token losses (fp32, ``labels``' shape, 0
            where ignored), as megatron-core's models return them to a masked loss function.
        chunk_size: tokens per chunk; default about 1 GiB of logits (4096 tokens at V = 128K in bf16).
        fp32_accumulate: accumulate the weight gradient across chunks in fp32 (``4 V H`` bytes, then
            cast); False accumulates in the weight's dtype (``2 V H`` bytes for bf16, one rounding per chunk).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        fp8: the logits and hidden-gradient GEMMs in FP8 with tensorwise scales (the module docstring); needs the
            Triton path and ``torch._scaled_mm`` (a GPU of compute capability >= 8.9, or the CPU under
            ``TRITON_INTERPRET=1``) and hidden size and vocabulary multiples of 16 (:func:`fp8_unsupported`):
            a :class:`ValueError` otherwise, never a silent bf16 run.

    Returns:
        A 0-dim fp32 loss (``[...]`` per-token losses with ``"none"``). Backward (once) gives ``hidden`` and
        ``weight`` gradients in their dtypes. Both are computed during forward, so between forward and
        backward the call holds the weight-gradient accumulator and a ``hidden``-sized buffer. With
        ``"none"``, a weight gradient whose incoming per-token gradients differ between counted tokens is
        recomputed in backward (exact, one more logits GEMM); equal ones (a mean or sum over the counted
        tokens) only scale the forward's.
    """
    _check(hidden, weight, labels, reduction)
    why = _why_not(hidden, weight)
    if fp8:
        shape_why = fp8_unsupported(weight.shape[1], weight.shape[0])
        if shape_why is not None:
            raise ValueError(f"fused_linear_cross_entropy(fp8=True): {shape_why}")
        if why is not None or backend == "reference" or not use_triton(backend, "fused_linear_cross_entropy",
                                                                      (hidden, weight, labels), why):
            raise ValueError(f"fused_linear_cross_entropy(fp8=True) needs its Triton path: "
                             f"{why or 'the Triton kernels cannot run here (a GPU, or TRITON_INTERPRET=1 on the CPU)'}")
    elif not use_triton(backend, "fused_linear_cross_entropy", (hidden, weight, labels), why):
        return fused_linear_cross_entropy_reference(hidden, weight, labels, ignore_index, z_loss, reduction,
                                                    chunk_size, fp32_accumulate)
    grad = torch.is_grad_enabled()
    return _FusedLinearCEFn.apply(hidden, weight, labels, int(ignore_index), float(z_loss), reduction, chunk_size,
                                  bool(fp32_accumulate), grad and hidden.requires_grad, grad and weight.requires_grad,
                                  bool(fp8))
