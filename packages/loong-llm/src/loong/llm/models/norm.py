"""RMSNorm for megatron-core's local layer spec under sequence parallelism.

megatron-core's ``WrappedTorchNorm`` (the norm of its local, Transformer-Engine-free spec) refuses
``sequence_parallel``: under SP each tensor-parallel rank normalises its own slice of the sequence, so the
weight's gradient is partial and must be summed over the TP group. megatron's ``finalize_model_grads`` does
that for every parameter marked ``sequence_parallel = True`` (Transformer Engine's and Apex's norms set the
mark); :class:`SPRMSNorm` is ``torch.nn.RMSNorm`` with the mark. MoE with tensor parallelism needs this:
megatron's ``MoELayer`` trains only with sequence parallelism when TP > 1.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class SPRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose weight carries megatron's ``sequence_parallel`` mark (TP gradient sum).

    ``for_qk``: QK-norm runs on whole sequences (after the QKV projection's gather) and megatron already
    sums its gradient over TP by name, so it gets no mark."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, *, for_qk: bool = False,
                 **_: Any) -> None:
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("SPRMSNorm is RMSNorm with a plain gamma")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel) and not for_qk
