"""Dense attention on a GPU (``pytest -m gpu``; CI deselects these, and without CUDA they skip): with the
``cudnn_attention`` capability (SDPA's cuDNN backend first) the output and every gradient in bf16 are as close to an
fp32 reference as torch's default kernel's are, for self-attention and for cross-attention to a short context."""

from __future__ import annotations

import pytest
import torch

from loong.core.accelerators import select_accelerator
from loong.core.attention import dense_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _run(q, k, v, capabilities):  # noqa: ANN001, ANN202
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = dense_attention(*leaves, False, q.shape[-1] ** -0.5, capabilities)
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("kv_len", [4096, 512], ids=["self", "cross"])
def test_cudnn_first_attention_is_as_accurate_as_the_default(kv_len: int) -> None:
    caps = select_accelerator().capabilities()
    if "cudnn_attention" not in caps:
        pytest.skip("this GPU does not report cudnn_attention (compute capability < 9.0)")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 12, 4096, 128, generator=g, device="cuda")
    k, v = (torch.randn(1, 12, kv_len, 128, generator=g, device="cuda") for _ in range(2))
    want = _run(q, k, v, ())
    fast = _run(q.bfloat16(), k.bfloat16(), v.bfloat16(), caps)
    default = _run(q.bfloat16(), k.bfloat16(), v.bfloat16(), ())
    for name, w, a, b in zip(("out", "dq", "dk", "dv"), want, fast, default, strict=True):
        err_fast = float((a.float() - w).norm() / w.norm())
        err_default = float((b.float() - w).norm() / w.norm())
        assert err_fast <= 2 * err_default + 1e-3, (name, err_fast, err_default)
