"""What both engines decide before converting a model's linear layers to FP8: the start-up checks, which layers
convert (the per-layer plan) and the log of that plan.

The engines differ only in which modules are linear layers and how a layer is converted (megatron's parallel
linears: :mod:`loong.core.engines.megatron.fp8`; ``torch.nn.Linear``: :mod:`loong.core.engines.fsdp.fp8`); the
rules here are the same for both, so a layer kept in bf16 for a reason on one engine is kept for the same reason,
and said in the same words, on the other. Megatron-free: the fsdp engine imports it.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from loong.core.accelerators.base import Accelerator
from loong.core.accelerators.capabilities import FP8
from loong.core.config.schema import PrecisionConfig
from loong.core.errors import LoongError
from loong.core.precision.adaptive import Decision, SpeedupTable, decide
from loong.core.precision.fp8_linear import native_support
from loong.core.precision.recipes import RECIPES, FP8Recipe


@dataclass(frozen=True)
class LayerPlan:
    """What happens to one linear layer: ``n`` x ``k`` weight (local shard), ``m`` tokens per micro-batch (0 where
    the engine does not know it before the first step)."""

    name: str
    m: int
    n: int
    k: int
    recipe: str | None
    speedup: float | None
    reason: str


@dataclass(frozen=True)
class Candidate:
    """A linear layer as an engine sees it: ``label`` in the plan and log, ``name`` matched by the exclusion globs,
    its weight's ``shape`` (None: no weight of its own) and ``keep``, an engine's own reason to keep it in bf16."""

    label: str
    name: str
    shape: tuple[int, ...] | None
    keep: str | None = None


def recipe_of(precision: PrecisionConfig) -> FP8Recipe:
    """The recipe ``precision.fp8`` runs (for ``adaptive``: where it pays)."""
    return RECIPES[precision.fp8_adaptive_recipe if precision.fp8 == "adaptive" else precision.fp8]


def dimension_multiple(recipe: FP8Recipe) -> int:
    """What a weight's two dimensions must be multiples of for ``torch._scaled_mm`` (whole 128 blocks for
    blockwise)."""
    return 128 if recipe.name == "blockwise" else 16


def matches(name: str, globs: Sequence[str]) -> bool:
    """Whether a module ``name`` is named by one of ``globs``: a glob over the whole dotted name, or the last part."""
    return any(fnmatch.fnmatchcase(name, g) or name.rsplit(".", 1)[-1] == g for g in globs)


def plan_layers(layers: Iterable[Candidate], precision: PrecisionConfig, tokens: int, *,
                table: SpeedupTable | None = None, native: bool = True) -> list[LayerPlan]:
    """Decide, for every candidate, whether and how it runs in fp8 under ``precision`` (``fp8=off``: no plan).

    ``tokens``: rows of a layer's input per micro-batch (0: unknown; then ``adaptive`` cannot decide). ``table`` is
    required for ``adaptive``. ``native=False`` (emulation) lifts the dimension rules.
    """
    mode = precision.fp8
    if mode == "off":
        return []
    recipe = recipe_of(precision)
    if mode == "adaptive" and (table is None or tokens <= 0):
        raise ValueError("plan_layers: precision.fp8=adaptive needs a speedup table and the tokens per micro-batch")
    mult = dimension_multiple(recipe)
    plans = []
    for c in layers:
        n, k = (c.shape[0], c.shape[1]) if c.shape is not None else (0, 0)
        reason = (c.keep or ("no weight of its own" if c.shape is None else None)
                  or ("precision.fp8_exclude" if matches(c.name, precision.fp8_exclude) else None)
                  or (f"{n}x{k} weight: _scaled_mm needs multiples of {mult}" if native and (n % mult or k % mult)
                      else None))
        if reason is not None:
            plans.append(LayerPlan(c.label, tokens, n, k, None, None, reason))
            continue
        d = decide(table, recipe, tokens, n, k, precision.fp8_adaptive_threshold) if mode == "adaptive" \
            else Decision(True, None, f"precision.fp8={mode}")  # type: ignore[arg-type]
        plans.append(LayerPlan(c.label, tokens, n, k, recipe.name if d.fp8 else None, d.speedup, d.reason))
    return plans


def summarize(plans: list[LayerPlan]) -> list[str]:
    """Log lines: layers grouped by name with the layer index as ``*``, shape (``[MxNxK]``: tokens x output x input
    features; ``?`` for tokens the engine does not know yet) and verdict."""
    groups: dict[tuple, int] = {}
    for p in plans:
        pattern = ".".join("*" if part.isdigit() else part for part in p.name.split("."))
        key = (pattern, p.m, p.n, p.k, p.recipe, None if p.speedup is None else round(p.speedup, 2), p.reason)
        groups[key] = groups.get(key, 0) + 1
    n_fp8 = sum(p.recipe is not None for p in plans)
    lines = [f"fp8: {n_fp8} of {len(plans)} linear layers run in fp8"]
    for (pattern, m, n, k, recipe, _s, reason), count in groups.items():
        shape = f" [{m or '?'}x{n}x{k}]" if n else ""
        lines.append(f"  {pattern} x{count}{shape}: {recipe or 'bf16'} ({reason})")
    return lines


def check_precision(precision: PrecisionConfig, accelerator: Accelerator, dtype: torch.dtype) -> None:
    """Fail before the model is built when ``precision.fp8`` cannot run here (``dtype``: the training dtype)."""
    mode = precision.fp8
    if mode == "off":
        return
    if FP8 not in accelerator.capabilities():
        raise LoongError(
            f"precision.fp8={mode} needs hardware FP8 matrix products (the '{FP8}' capability: NVIDIA GPUs of "
            f"compute capability 8.9 or newer, e.g. L40S, H100, H200); the '{accelerator.name}' accelerator does "
            "not report it. Set precision.fp8=off"
        )
    if dtype != torch.bfloat16:
        raise LoongError(f"precision.fp8={mode} needs bf16 training, but the run trains in {dtype}; "
                         "set train.precision=bf16")


def warn_if_emulated(recipe: FP8Recipe, device: torch.device) -> None:
    """Warn where blockwise GEMMs will be emulated on this GPU. Asking also runs the one-time blockwise probe
    (which reads a result back to the host) here, at conversion, rather than inside a step a CUDA graph captures;
    other recipes never probe."""
    if device.type != "cuda" or recipe.name != "blockwise":  # only blockwise GEMMs are probed
        return
    support = native_support(device)
    if not (support["blockwise_fwd"] and support["blockwise_wgrad"]):
        warnings.warn(f"fp8 blockwise: this GPU/torch has no native kernel for some of its GEMMs ({support}); "
                      "those are emulated (dequantise + bf16 matmul), slower than bf16", stacklevel=3)
