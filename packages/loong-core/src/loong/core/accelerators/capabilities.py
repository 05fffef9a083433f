"""The names an accelerator may report from ``capabilities()``, and what each one promises.

Models and engines choose fused paths by asking for these names; a name that is absent means "use the
plain-PyTorch reference". Keeping the vocabulary in one place lets the contract tests reject a typo in
a plugin (``"flash-attn"`` instead of ``"flash_attn"``) that would otherwise silently disable a path.
"""

from __future__ import annotations

from collections.abc import Iterable

from loong.core.errors import LoongError, did_you_mean

SDPA = "sdpa"
TRITON = "triton"
TRANSFORMER_ENGINE = "transformer_engine"
FLASH_ATTN = "flash_attn"
FP8 = "fp8"
OPTIMIZER_OFFLOAD = "optimizer_offload"
GROUPED_MM = "grouped_mm"
FLEX_ATTENTION = "flex_attention"

#: name -> what reporting it promises. Reporting a name is a promise that the path works on this
#: hardware, not merely that a package imports.
CAPABILITIES: dict[str, str] = {
    SDPA: "torch.nn.functional.scaled_dot_product_attention runs on the device",
    TRITON: "Triton kernels written for NVIDIA GPUs (loong-kernels) compile and run on the device",
    TRANSFORMER_ENGINE: "Transformer Engine's modules run (megatron-core's TE layer spec, TE norms)",
    FLASH_ATTN: "the flash-attn package's kernels run on the device",
    FP8: "hardware FP8 (e4m3/e5m2) matrix products, so FP8 recipes can run; absent: bf16 only",
    OPTIMIZER_OFFLOAD: "megatron-core's HybridDeviceOptimizer runs (CUDA streams and pinned host memory), so "
                       "train.optimizer_cpu_offload can keep the optimizer state in host memory",
    GROUPED_MM: "torch._grouped_mm has fast bf16 kernels on the device (CUDA sm90+), so MoE experts run as grouped "
                "matrix products by default (model.moe_grouped_mm=auto)",
    FLEX_ATTENTION: "torch.compile'd FlexAttention (torch.nn.attention.flex_attention) runs forward and backward on "
                    "the device, so packed (varlen) and context-parallel attention take it (loong.core.attention)",
}


def check_capabilities(names: Iterable[str], source: str) -> set[str]:
    """Return ``names`` as a set, or fail naming the first unknown one (and the closest known one)."""
    out = set(names)
    for name in sorted(out):
        if name not in CAPABILITIES:
            raise LoongError(
                f"{source}: unknown capability '{name}'{did_you_mean(name, CAPABILITIES)} "
                f"(known: {', '.join(sorted(CAPABILITIES))})"
            )
    return out
