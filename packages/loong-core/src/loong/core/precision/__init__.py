"""Precision: FP8 execution of linear layers (tensorwise, rowwise, blockwise, adaptive). See docs/fp8.md.

- :mod:`~loong.core.precision.recipes`: the recipes and operand quantisation (loong-kernels' quantisers);
- :mod:`~loong.core.precision.fp8_linear`: ``fp8_mm`` (``torch._scaled_mm`` or emulation) and the FP8
  linear autograd op with megatron's tensor-parallel communication;
- :mod:`~loong.core.precision.adaptive`: per-layer decisions from measured speedup tables, the probe;
- :mod:`~loong.core.precision.plan`: what both engines share: the start-up checks, the per-layer plan
  (exclusions, dimension rules) and its log.

Converting a built model's linears in place is the engines' (:mod:`loong.core.engines.megatron.fp8` for megatron's
parallel linears, :mod:`loong.core.engines.fsdp.fp8` for ``torch.nn.Linear``).
"""

from loong.core.precision.adaptive import H200_TABLE, SpeedupTable, decide, layer_speedup, probe, table_for
from loong.core.precision.fp8_linear import FP8LinearFunction, LinearComm, fp8_mm, linear_fp8, native_support
from loong.core.precision.recipes import (
    BLOCKWISE,
    RECIPES,
    ROWWISE,
    TENSORWISE,
    FP8Recipe,
    Quantized,
    quantize,
)

__all__ = [
    "BLOCKWISE",
    "H200_TABLE",
    "RECIPES",
    "ROWWISE",
    "TENSORWISE",
    "FP8LinearFunction",
    "FP8Recipe",
    "LinearComm",
    "Quantized",
    "SpeedupTable",
    "decide",
    "linear_fp8",
    "fp8_mm",
    "layer_speedup",
    "native_support",
    "probe",
    "quantize",
    "table_for",
]
