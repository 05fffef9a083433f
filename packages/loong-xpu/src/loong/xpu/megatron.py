"""What stock megatron-core needs to run on Kunlun XPUs.

No module of megatron-core is patched: torch_xmlir presents the cards through ``torch.cuda`` and routes
``"nccl"`` to BKCL, so megatron-core's CUDA calls (streams, events, RNG trackers, ``device="cuda"``)
reach Kunlun unchanged -- unlike the CPU, where ``loong.core.accelerators.megatron_cpu`` has to swap them.
What remains are the fused paths built on NVIDIA-only extensions (apex, Transformer Engine), which
must stay off. They are TransformerConfig fields, so they are passed per run through
``megatron_config_overrides()`` and leave no global state behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConfigOverride:
    """TransformerConfig ``field=value`` on Kunlun, and why."""

    field: str
    value: Any
    why: str


CONFIG_OVERRIDES: tuple[ConfigOverride, ...] = (
    ConfigOverride("gradient_accumulation_fusion", False,
                   "fuses the weight-gradient GEMM through apex's fused_weight_gradient_mlp_cuda or TE; "
                   "neither exists for Kunlun (FlagScale's Kunlun scripts pass --no-gradient-accumulation-fusion)"),
    ConfigOverride("masked_softmax_fusion", False,
                   "megatron's fused scaled-masked softmax is a CUDA extension (apex / TE)"),
    ConfigOverride("apply_rope_fusion", False, "fused RoPE comes from Transformer Engine or apex"),
    ConfigOverride("persist_layer_norm", False, "apex's persistent LayerNorm CUDA kernel"),
)


def config_overrides() -> dict[str, Any]:
    """The overrides as the ``{field: value}`` dict the models merge into their TransformerConfig."""
    return {o.field: o.value for o in CONFIG_OVERRIDES}
