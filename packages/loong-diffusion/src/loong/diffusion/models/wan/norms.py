"""The two normalisations of a Wan block: RMSNorm of q and k (over all heads together), and LayerNorm computed in
float32 whatever the activations' dtype (diffusers' ``FP32LayerNorm``: the modulated norms and the cross-attention
norm stay exact under bf16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loong.kernels import Backend, rms_norm


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension: PyTorch's (``backend=None``) or loong-kernels' fused
    RMSNorm with that kernel backend (``"auto"``, which the model picks where the accelerator reports Triton: the
    Triton kernel on CUDA tensors, its reference elsewhere; ``"triton"`` insists on the kernel)."""

    def __init__(self, dim: int, eps: float, backend: Backend | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x [..., dim]``."""
        if self.backend is not None:
            return rms_norm(x, self.weight, self.eps, backend=self.backend)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, backend={self.backend}"


class LayerNorm32(nn.Module):
    """LayerNorm over the last dimension in float32, returned in the input's dtype; ``affine`` adds a weight and a
    bias (the modulated norms of a block have none: the timestep modulation scales and shifts instead)."""

    def __init__(self, dim: int, eps: float, affine: bool = True) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x [..., dim]``."""
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), (self.dim,), weight, bias, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, affine={self.weight is not None}"


__all__ = ["LayerNorm32", "RMSNorm"]
