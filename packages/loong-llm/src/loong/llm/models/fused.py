"""loong-kernels' fused ops as drop-in modules for megatron-core's layer spec, and the switch that picks them.

``model.fused_kernels`` (``auto`` | ``on`` | ``off``) resolves, with the accelerator's capabilities and the
parallel layout, into a :class:`FusedKernels` plan: which ops take the fused path and which dispatcher
``backend`` the kernels get. The model code stays megatron-core's; only modules in the spec change:

- RMSNorm: :class:`FusedRMSNorm` for ``input_layernorm``, ``pre_mlp_layernorm``, QK-norm and the final
  norm (a ``weight`` parameter, like ``torch.nn.RMSNorm``, so state-dict keys and the HF mapping are
  unchanged);
- SwiGLU: :class:`FusedSwiGLU` as the MLP's activation module, applied to the whole fused gate-up output;
- RoPE: :class:`~loong.llm.models.attention.FusedRoPESelfAttention`;
- the output layer's cross-entropy: :func:`fused_lm_loss` (per-token losses without the logits tensor), in
  :class:`~loong.llm.models.gpt.LoongGPTModel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from loong.core.errors import LoongError

FusedMode = Literal["auto", "on", "off"]
FUSED_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class FusedKernels:
    """Which ops take loong-kernels' fused path, and the dispatcher ``backend`` the kernels are called with.

    ``backend="auto"`` runs Triton for CUDA tensors the kernel supports and the plain-PyTorch reference
    otherwise; ``"triton"`` insists (an unsupported input raises ``KernelUnsupportedError`` with the reason);
    ``"reference"`` runs the references (CPU tests of the wiring).
    """

    norm: bool = False
    swiglu: bool = False
    rope: bool = False
    cross_entropy: bool = False
    backend: Literal["auto", "triton", "reference"] = "auto"

    @classmethod
    def everything(cls, backend: Literal["auto", "triton", "reference"] = "auto") -> FusedKernels:
        """Every op fused (what ``on`` gives at TP = 1 without Transformer Engine)."""
        return cls(norm=True, swiglu=True, rope=True, cross_entropy=True, backend=backend)


def fused_backend(mode: str, capabilities: set[str]) -> Literal["auto", "triton"] | None:
    """The kernels' backend for ``model.fused_kernels=mode``: None (fuse nothing: ``off``, or ``auto`` without the
    ``triton`` capability), ``auto`` or ``triton`` (``on``); ``on`` without ``triton`` is a :class:`LoongError`."""
    if mode not in FUSED_MODES:
        raise LoongError(f"model.fused_kernels must be one of {', '.join(FUSED_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    if "triton" not in capabilities:
        if mode == "on":
            raise LoongError(
                "model.fused_kernels=on needs the Triton kernels of loong-kernels, but this accelerator does not "
                f"report the 'triton' capability (it reports: {', '.join(sorted(capabilities)) or 'none'}); "
                "use model.fused_kernels=auto (fused where available) or off"
            )
        return None
    return "triton" if mode == "on" else "auto"


def resolve_fused_kernels(mode: str, capabilities: set[str], config: TransformerConfig) -> FusedKernels:
    """The plan for ``model.fused_kernels=mode`` on an accelerator with ``capabilities``.

    - ``off``: none; megatron-core's modules as they are.
    - ``auto``: every applicable op where the accelerator reports ``triton``, none elsewhere (the CPU
      keeps megatron-core's PyTorch path); kernels dispatch with ``backend="auto"``.
    - ``on``: like ``auto`` but the accelerator must report ``triton`` (a :class:`LoongError` otherwise) and
      the kernels are called with ``backend="triton"``, so an input they cannot take fails loudly.

    Applicable: with Transformer Engine installed its layer spec already fuses norms, activation and RoPE,
    so only the loss is ours. The fused cross-entropy needs the whole vocabulary on one rank (TP = 1);
    RoPE needs context parallelism off and no per-layer ``no_rope``.
    """
    backend = fused_backend(mode, capabilities)
    if backend is None:
        return FusedKernels()
    layers = "transformer_engine" not in capabilities
    return FusedKernels(
        norm=layers and not config.sequence_parallel,  # FusedRMSNorm has no SP gradient mark
        swiglu=layers and config.gated_linear_unit and config.activation_func is F.silu,
        rope=layers and config.context_parallel_size == 1 and not config.no_rope_freq,
        cross_entropy=config.tensor_model_parallel_size == 1,
        backend=backend,
    )


class FusedRMSNorm(torch.nn.Module):
    """RMSNorm through ``loong.kernels.rms_norm``: a drop-in for megatron-core's ``WrappedTorchNorm``.

    Same constructor arguments and the same single ``weight`` parameter (ones, as ``torch.nn.RMSNorm``), so
    checkpoints, the HF mapping and megatron's sharded keys (``input_layernorm.weight`` ...) are unchanged.
    Works on any leading shape: ``[s, b, h]`` for the layer norms, ``[s, b, heads, head_dim]`` for QK-norm.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, *,
                 backend: str = "auto", **_: Any) -> None:
        super().__init__()
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("FusedRMSNorm is RMSNorm with a plain gamma")
        if config.sequence_parallel:  # the weight's gradient would need megatron's SP all-reduce marking
            raise ValueError("FusedRMSNorm does not support sequence parallelism")
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from loong.kernels import rms_norm

        return rms_norm(x, self.weight, self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, backend={self.backend}"


class FusedSwiGLU(torch.nn.Module):
    """``silu(gate) * up`` on megatron's fused ``linear_fc1`` output ``[..., 2 * ffn]`` (gate first).

    Plugged in as ``MLPSubmodules.activation_func``: megatron-core's MLP then calls it on the whole fc1
    output (``config.use_te_activation_func``, which despite its name only selects the spec's module).
    No parameters, so the MLP's state dict is unchanged.
    """

    def __init__(self, *, config: TransformerConfig, backend: str = "auto") -> None:
        super().__init__()
        self.backend = backend

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        from loong.kernels import swiglu

        return swiglu(gate_up, backend=self.backend)


def fused_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, backend: str,
                  fp8: bool = False) -> torch.Tensor:
    """Per-token losses ``[b, s]`` of the output layer ``hidden [s, b, H] @ weight.T`` against ``labels [b, s]``.

    What megatron-core's ``output_layer`` + ``compute_language_model_loss`` return at TP = 1 (fp32 per-token
    cross-entropy, so the task's ``losses * loss_mask`` is unchanged), without the ``[s, b, V]`` logits and
    their fp32 copy. Equal per-token weights from the loss function (a mean over the tokens) keep the
    kernel's single logits GEMM; unequal ones cost one more in backward (still exact). ``fp8``: the logits and
    hidden-gradient GEMMs in FP8 (``precision.fp8_output_layer``).
    """
    from loong.kernels import fused_linear_cross_entropy

    losses = fused_linear_cross_entropy(hidden, weight, labels.t(), reduction="none", backend=backend, fp8=fp8)
    return losses.t().contiguous()
