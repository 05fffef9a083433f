"""Loong kernels: fused Triton kernels, each beside its plain-PyTorch reference.

Every op ``f`` comes as

- ``f(..., backend="auto")``: the Triton kernel for CUDA tensors it supports, the reference otherwise;
  ``backend="triton"`` insists (raising :class:`KernelUnsupportedError` with the reason),
  ``backend="reference"`` takes the reference;
- ``f_reference(...)``: the plain-PyTorch twin with the same arguments (less ``backend``).

Activations use megatron-core's layouts: ``[s, b, hidden]`` for norms, SwiGLU and the loss, and
``[s, b, heads, head_dim]`` for RoPE (other layouts through ``apply_rope(layout=...)``).
See ``docs/kernels.md`` for the contracts and measured speed.
"""

from importlib.metadata import version as _package_version

from loong.kernels._dispatch import Backend, KernelUnsupportedError, interpreting, triton_available
from loong.kernels.cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_reference
from loong.kernels.dsa import (
    indexer_scores_reference,
    indexer_topk,
    indexer_topk_reference,
    sparse_mla_attention,
    sparse_mla_attention_reference,
)
from loong.kernels.fp8 import (
    FP8_MAX,
    dequantize,
    dequantize_reference,
    quantize_blockwise,
    quantize_blockwise_reference,
    quantize_rowwise,
    quantize_rowwise_reference,
    quantize_tensorwise,
    quantize_tensorwise_reference,
    transpose_2d,
)
from loong.kernels.gemm import mm_accumulate
from loong.kernels.norm import rms_norm, rms_norm_reference
from loong.kernels.rope import (
    Llama3RopeScaling,
    apply_rope,
    apply_rope_reference,
    rope_cos_sin,
    rope_inv_freq,
)
from loong.kernels.swiglu import swiglu, swiglu_reference

__version__ = _package_version("loong-kernels")  # pyproject.toml's `version`, the one source

__all__ = [
    "FP8_MAX",
    "Backend",
    "KernelUnsupportedError",
    "Llama3RopeScaling",
    "apply_rope",
    "apply_rope_reference",
    "dequantize",
    "dequantize_reference",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_reference",
    "indexer_scores_reference",
    "indexer_topk",
    "indexer_topk_reference",
    "interpreting",
    "mm_accumulate",
    "quantize_blockwise",
    "quantize_blockwise_reference",
    "quantize_rowwise",
    "quantize_rowwise_reference",
    "quantize_tensorwise",
    "quantize_tensorwise_reference",
    "transpose_2d",
    "rms_norm",
    "rms_norm_reference",
    "rope_cos_sin",
    "rope_inv_freq",
    "sparse_mla_attention",
    "sparse_mla_attention_reference",
    "swiglu",
    "swiglu_reference",
    "triton_available",
]
