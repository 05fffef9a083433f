"""``acc = beta * acc + a @ b`` in one GEMM, whatever ``acc``'s dtype: the fused weight-gradient accumulation.

Megatron keeps fp32 gradient buffers (``main_grad``) for bf16 weights. The unfused backward computes each weight
gradient in bf16 and adds it to the buffer in a second kernel, which reads and writes the whole fp32 buffer once
more per layer and micro-batch; APEX's and Transformer Engine's ``wgrad_gemm_accum_fp32`` write the product
straight into it. cuBLAS does that for bf16/fp16 operands with an fp32 output (``torch.addmm(out_dtype=...)``), so
no extension is needed. The fused linear + cross-entropy accumulates its weight gradient across chunks the same
way.
"""

from __future__ import annotations

import torch


def mm_accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """``acc = beta * acc + a @ b`` in place, the product accumulating in fp32 inside the GEMM; ``acc`` keeps its
    dtype (fp32 from bf16/fp16 operands on CUDA: one cuBLAS call; elsewhere the operands are cast first).

    ``beta=0`` overwrites ``acc`` (its old values are never read, so it may be uninitialised). Returns ``acc``.
    """
    if acc.dtype == a.dtype:
        torch.addmm(acc, a, b, beta=beta, out=acc)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, beta=beta, out=acc)
    else:  # CPU (interpreter tests) or mixed dtypes cuBLAS does not take
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)
    return acc
