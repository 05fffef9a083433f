"""Turn a built model's linear layers into FP8-executing ones, in place, before DDP wraps them.

Each converted megatron parallel linear gets its class swapped (:mod:`~loong.core.engines.megatron.linear_swap`)
for a subclass whose ``_forward_impl`` runs :class:`~loong.core.precision.fp8_linear.FP8LinearFunction` instead;
:func:`remove_fp8` swaps the classes back.

Kept in high precision: the output layer (``output_layer``, whose logits feed the loss), layers without
a weight of their own, norms (not linear layers), layers named in ``precision.fp8_exclude`` and, natively,
layers whose dimensions ``torch._scaled_mm`` cannot take (multiples of 16; 128 for blockwise). Deferred
embedding weight gradients and GTP-sharded weights fall back to megatron's own path per call.

With Transformer Engine's layer spec, the linear layers are TE modules: FP8 then goes through TE's own
recipes via megatron's ``TransformerConfig.fp8`` / ``fp8_recipe`` (tensorwise and blockwise only).
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from loong.core.accelerators.base import Accelerator
from loong.core.accelerators.capabilities import FP8
from loong.core.config.schema import PrecisionConfig
from loong.core.engines.megatron.linear_swap import is_te_linear, linear_call, restore_classes, with_mixin
from loong.core.engines.megatron.state import unwrap
from loong.core.errors import LoongError
from loong.core.precision.adaptive import Decision, SpeedupTable, decide, table_for
from loong.core.precision.fp8_linear import FP8LinearFunction, native_support
from loong.core.precision.recipes import RECIPES, FP8Recipe


class FP8LinearMixin:
    """``_forward_impl`` with fp8 GEMMs; everything else is the megatron layer's own."""

    fp8_recipe: FP8Recipe
    fp8_native: bool

    def _forward_impl(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        # megatron's own ``gradient_accumulation_fusion`` flag decides whether dW goes to main_grad here
        comm = linear_call(self, args, kwargs, fuse_wgrad=bool(kwargs.get("gradient_accumulation_fusion")))
        if comm is None:  # features this path does not implement: megatron's bf16 path for this call
            return super()._forward_impl(*args, **kwargs)  # type: ignore[misc]
        return FP8LinearFunction.apply(kwargs["input"], kwargs["weight"], kwargs.get("bias"), self.fp8_recipe,
                                       comm, self.fp8_native)

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, fp8={self.fp8_recipe.name}{'' if self.fp8_native else ' (emulated)'}"


class FP8ColumnParallelLinear(FP8LinearMixin, ColumnParallelLinear):
    """A ``ColumnParallelLinear`` whose GEMMs run in fp8."""


class FP8RowParallelLinear(FP8LinearMixin, RowParallelLinear):
    """A ``RowParallelLinear`` whose GEMMs run in fp8."""


_FP8_CLASSES: dict[type, type] = {ColumnParallelLinear: FP8ColumnParallelLinear,
                                  RowParallelLinear: FP8RowParallelLinear}


def convert_to_fp8(module: torch.nn.Module, recipe: FP8Recipe, native: bool = True) -> None:
    """Make one megatron parallel linear run its GEMMs in ``recipe`` (``native=False``: emulated)."""
    if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
        raise TypeError(f"convert_to_fp8 takes megatron's parallel linear layers, not {type(module).__name__}")
    module.__class__ = with_mixin(type(module), FP8LinearMixin, "FP8", _FP8_CLASSES)  # e.g. LoRA's: FP8 below
    module.fp8_recipe, module.fp8_native = recipe, native  # type: ignore[attr-defined]


def remove_fp8(chunks: Iterable[torch.nn.Module]) -> int:
    """Swap every converted layer back to its original class; returns how many there were."""
    restored = restore_classes(chunks, FP8LinearMixin)
    for module in restored:
        del module.fp8_recipe, module.fp8_native
    return len(restored)


@dataclass(frozen=True)
class LayerPlan:
    """What happens to one linear layer: ``n`` x ``k`` weight (local shard), ``m`` tokens per micro-batch."""

    name: str
    m: int
    n: int
    k: int
    recipe: str | None
    speedup: float | None
    reason: str


def _native_ok(recipe: FP8Recipe, n: int, k: int) -> bool:
    mult = 128 if recipe.name == "blockwise" else 16
    return n % mult == 0 and k % mult == 0


def plan_fp8(chunks: Iterable[torch.nn.Module], precision: PrecisionConfig, tokens: int, *,
             table: SpeedupTable | None = None, native: bool = True) -> list[LayerPlan]:
    """Decide, for every megatron linear layer of ``chunks``, whether and how it runs in fp8.

    ``tokens``: rows of a layer's input per micro-batch (sequence length x micro-batch size). ``table``
    is required for ``adaptive``. ``native=False`` (emulation) lifts the dimension rules.
    """
    mode = precision.fp8
    if mode == "off":
        return []
    recipe = RECIPES[precision.fp8_adaptive_recipe if mode == "adaptive" else mode]
    if mode == "adaptive" and table is None:
        raise ValueError("plan_fp8: precision.fp8=adaptive needs a speedup table")
    plans = []
    for i, chunk in enumerate(chunks):
        for name, module in unwrap(chunk).named_modules():
            if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
                continue
            label = name if i == 0 else f"chunk{i}.{name}"
            w = module.weight
            n, k = (w.shape[0], w.shape[1]) if w is not None else (0, 0)

            def keep(reason: str, label: str = label, n: int = n, k: int = k) -> None:
                plans.append(LayerPlan(label, tokens, n, k, None, None, reason))

            if name.rsplit(".", 1)[-1] == "output_layer":
                keep("output layer")
            elif w is None:
                keep("no weight of its own")
            elif any(fnmatch.fnmatchcase(name, g) or name.rsplit(".", 1)[-1] == g for g in precision.fp8_exclude):
                keep("precision.fp8_exclude")
            elif native and not _native_ok(recipe, n, k):
                keep(f"{n}x{k} weight: _scaled_mm needs multiples of {128 if recipe.name == 'blockwise' else 16}")
            else:
                d = decide(table, recipe, tokens, n, k, precision.fp8_adaptive_threshold) if table is not None \
                    and mode == "adaptive" else Decision(True, None, f"precision.fp8={mode}")
                plans.append(LayerPlan(label, tokens, n, k, recipe.name if d.fp8 else None, d.speedup, d.reason))
    return plans


def convert_linears(chunks: list[torch.nn.Module], plans: Iterable[LayerPlan], native: bool = True) -> int:
    """Apply ``plans`` (from :func:`plan_fp8` on the same chunks); returns the number of fp8 layers."""
    by_name = {p.name: p for p in plans if p.recipe is not None}
    n = 0
    for i, chunk in enumerate(chunks):
        for name, module in unwrap(chunk).named_modules():
            plan = by_name.get(name if i == 0 else f"chunk{i}.{name}")
            if plan is not None:
                convert_to_fp8(module, RECIPES[plan.recipe], native)  # type: ignore[index]
                n += 1
    return n


def summarize(plans: list[LayerPlan]) -> list[str]:
    """Log lines: layers grouped by name with the layer index as ``*``, shape and verdict."""
    groups: dict[tuple, int] = {}
    for p in plans:
        pattern = ".".join("*" if part.isdigit() else part for part in p.name.split("."))
        key = (pattern, p.m, p.n, p.k, p.recipe, None if p.speedup is None else round(p.speedup, 2), p.reason)
        groups[key] = groups.get(key, 0) + 1
    n_fp8 = sum(p.recipe is not None for p in plans)
    lines = [f"fp8: {n_fp8} of {len(plans)} linear layers run in fp8"]
    for (pattern, m, n, k, recipe, _s, reason), count in groups.items():
        shape = f" [{m}x{n}x{k}]" if n else ""
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


def _enable_te_fp8(models: list[torch.nn.Module], precision: PrecisionConfig) -> str:
    """FP8 of Transformer Engine's layers through megatron's config (read by its forward, per layer)."""
    if precision.fp8 not in ("tensorwise", "blockwise"):
        raise LoongError(f"precision.fp8={precision.fp8} is not one of Transformer Engine's recipes here; with TE "
                         "use precision.fp8=tensorwise or blockwise (or uninstall TE for Loong's own recipes)")
    for m in models:
        m.config.fp8 = "hybrid" if precision.fp8 == "tensorwise" else "e4m3"
        m.config.fp8_recipe = precision.fp8
    return f"fp8: Transformer Engine's {precision.fp8} recipe on its linear layers (TransformerConfig.fp8)"


def _shared_table(shapes: set[tuple[int, int, int]], recipe: FP8Recipe, device: torch.device,
                  precision: PrecisionConfig, echo: Callable[[str], None]) -> SpeedupTable:
    """Rank 0 loads or probes the table and sends it to every rank, so all ranks decide alike."""
    def build() -> SpeedupTable:
        return table_for(shapes, recipe, device, probe_missing=precision.fp8_probe, path=precision.fp8_table,
                         echo=echo)

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return build()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = build().to_json()
        except Exception as exc:  # every rank must leave the broadcast, then all raise
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return SpeedupTable.from_json(box[0])


def apply_fp8(chunks: list[torch.nn.Module], cfg: Any, accelerator: Accelerator, local_rank: int = 0,
              echo: Callable[[str], None] | None = print) -> list[LayerPlan]:
    """The engine's hook: convert ``chunks`` (before DDP) as ``cfg.precision`` says and log the plan.

    ``cfg`` is the run config (``precision``, ``train.seq_length``/``micro_batch_size``, ``parallel.cp``);
    ``echo`` prints on the logging rank (None elsewhere).
    """
    precision: PrecisionConfig = cfg.precision
    if precision.fp8 == "off":
        return []
    say = echo or (lambda _line: None)
    models = [unwrap(c) for c in chunks]
    if any(is_te_linear(m) for model in models for m in model.modules()):
        say(_enable_te_fp8(models, precision))
        return []
    device = accelerator.device(local_rank)
    tokens = cfg.train.seq_length // max(cfg.parallel.cp, 1) * cfg.train.micro_batch_size
    recipe = RECIPES[precision.fp8_adaptive_recipe if precision.fp8 == "adaptive" else precision.fp8]
    table = None
    if precision.fp8 == "adaptive":
        shapes = {(tokens, p.n, p.k) for p in plan_fp8(models, PrecisionConfig(fp8=recipe.name, fp8_exclude=
                  precision.fp8_exclude), tokens) if p.recipe is not None}
        table = _shared_table(shapes, recipe, device, precision, say)
    plans = plan_fp8(models, precision, tokens, table=table)
    convert_linears(models, plans)
    for line in summarize(plans):
        say(line)
    support = native_support(device)
    if recipe.name == "blockwise" and not (support["blockwise_fwd"] and support["blockwise_wgrad"]):
        warnings.warn(f"fp8 blockwise: this GPU/torch has no native kernel for some of its GEMMs ({support}); "
                      "those are emulated (dequantise + bf16 matmul), slower than bf16", stacklevel=2)
    return plans
